"""The directory `diag merge` writes into, held by a descriptor, and its files written without
following a symlink.

A timeline is often writable by the job, so anything in it may have been planted: a symlink
named `merged-<id>`, `summary.txt` or a temp name would otherwise carry our writes anywhere. The
directory is opened once (its last component never followed; a symlink there is refused, not
removed: it is not ours to delete), and every file is created new under a random temp name
beside it and renamed into place, which replaces a planted symlink rather than following it.
What the user named on the command line (the timeline root, --out's parent directories) is
taken as given.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from diag.formats.inputcaps import clean
from diag.formats.untrusted import UntrustedInput, create_new, walk_beneath, write_replace
from diag.viewer.incidents import IncidentError

DIR_MODE = 0o755  # as before: a merge's pictures are for whoever reads the timeline
FILE_MODE = 0o644


class OutputDir:
    """An open output directory; `path` is how it is named in messages and results."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    @contextlib.contextmanager
    def open(
        cls, base: Path, parts: tuple[str, ...] = (), create: bool = False
    ) -> Iterator[OutputDir]:
        """`base` (as the user named it) and then `parts` beneath it, none of them followed if
        a symlink; with `create`, missing directories are made."""
        with contextlib.ExitStack() as stack:
            try:
                if create:
                    os.makedirs(base, exist_ok=True)
                base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                raise IncidentError(
                    f"cannot open {clean(str(base))} for the outputs: {e.strerror or e}; give "
                    "--out a directory the outputs can be written to"
                ) from None
            stack.callback(os.close, base_fd)
            try:
                fd = stack.enter_context(walk_beneath(base_fd, parts, create=create, mode=DIR_MODE))
            except UntrustedInput as e:
                raise IncidentError(
                    f"{clean(str(base.joinpath(*parts)))}: {e.problem}; diag merge does not "
                    "write through symlinks: remove it, or give --out a real directory"
                ) from None
            except OSError as e:
                raise IncidentError(
                    f"cannot make {clean(str(base.joinpath(*parts)))} for the outputs: "
                    f"{e.strerror or e}; give --out a directory the outputs can be written to"
                ) from None
            yield cls(base.joinpath(*parts), fd)

    @classmethod
    def given(cls, out: Path) -> contextlib.AbstractContextManager[OutputDir]:
        """--out: its parents are made and followed as given; its last component must not be a
        symlink."""
        out = Path(out)
        if out.name in ("", ".", ".."):
            return cls.open(out, (), create=True)
        return cls.open(out.parent, (out.name,), create=True)

    def write(self, name: str, data: bytes) -> Path:
        write_replace(self.fd, name, data, mode=FILE_MODE)
        return self.path / name

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[TextIO]:
        """A text file written in pieces, renamed into place when done (a reader never sees half
        of it; a symlink at the name is replaced, not followed)."""
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = create_new(tmp, dir_fd=self.fd, mode=FILE_MODE)
        try:
            with os.fdopen(fd, "w") as fh:
                yield fh
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)
            raise
