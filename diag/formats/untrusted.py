"""Reading and writing where another process could have been first.

Everything diag reads from a shared directory (journals, metas, slots, dumps, reports, configs)
was written by another process, and a directory someone else can write may hold a FIFO, a
symlink, a device or a file of any size under any name. The rules, in one place:

- open without following a symlink and without blocking (a FIFO would hang open()), then check
  on the open descriptor that it is a regular file, owned by whom we expect, under a size cap;
- a path named by input is relative, has no `..`, and is walked one component at a time from a
  directory descriptor with O_NOFOLLOW, so it cannot leave its base whatever is planted;
- a file we write is created new (O_EXCL|O_NOFOLLOW) under a temp name and renamed into place;
  modes come from us, never from input;
- text that reaches a terminal or a summary file loses its control characters.

Every refusal is an `UntrustedInput` naming the file and what is wrong with it, so callers
report it in one line and go on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# The value checks live in `refusals` (pure); every reader imports them from here too.
from diag.formats.refusals import KIB as KIB
from diag.formats.refusals import MIB as MIB
from diag.formats.refusals import UntrustedInput as UntrustedInput
from diag.formats.refusals import bounded_int as bounded_int
from diag.formats.refusals import printable as printable

# The problem of an UntrustedInput for a file that is not there: most readers take that as "none
# yet", not as a refusal.
MISSING = "does not exist"

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Owners:
    """The users whose files we believe. Root always counts: it could write anything anyway."""

    uids: frozenset[int]

    @classmethod
    def of(cls, *uids: int) -> Owners:
        return cls(frozenset({0, *uids}))

    @classmethod
    def this_process(cls) -> Owners:
        return cls.of(os.geteuid())

    def trusts(self, st: os.stat_result) -> bool:
        return st.st_uid in self.uids

    def check(self, path: str | os.PathLike[str], st: os.stat_result) -> None:
        if not self.trusts(st):
            allowed = ", ".join(str(u) for u in sorted(self.uids))
            raise UntrustedInput(
                path, f"owned by uid {st.st_uid}, not by a trusted user ({allowed})"
            )


def describe_mode(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_error(path: str | os.PathLike[str], err: OSError) -> UntrustedInput:
    if err.errno == errno.ELOOP:
        return UntrustedInput(
            path, "is a symlink; diag does not follow symlinks in shared directories"
        )
    if err.errno == errno.ENOENT:
        return UntrustedInput(path, MISSING)
    if err.errno in (errno.EACCES, errno.EPERM):
        return UntrustedInput(path, "permission denied")
    return UntrustedInput(path, f"cannot open: {err.strerror or err}")


def open_regular(
    path: str | os.PathLike[str],
    *,
    max_bytes: int,
    owners: Owners | None = None,
    dir_fd: int | None = None,
    flags: int = 0,
) -> tuple[int, os.stat_result]:
    """Opens `path` for reading as a regular file of at most `max_bytes`, without following a
    symlink or blocking on a FIFO. Returns the descriptor (blocking again) and its stat."""
    try:
        fd = os.open(path, _READ_FLAGS | flags, dir_fd=dir_fd)
    except OSError as e:
        raise open_error(path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedInput(path, f"is {describe_mode(st.st_mode)}, expected a regular file")
        if owners is not None:
            owners.check(path, st)
        if st.st_size > max_bytes:
            raise UntrustedInput(
                path,
                f"is {st.st_size} bytes, over the {max_bytes}-byte limit for this kind of file",
            )
        os.set_blocking(fd, True)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def read_bounded(
    path: str | os.PathLike[str],
    *,
    max_bytes: int,
    owners: Owners | None = None,
    dir_fd: int | None = None,
) -> bytes:
    """The whole content of a regular file, refusing one over `max_bytes` (also one that grows
    past it while we read)."""
    fd, st = open_regular(path, max_bytes=max_bytes, owners=owners, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        # Ask for the size fstat gave (plus one, to see growth), not the cap: read(n) allocates n.
        data = f.read(min(st.st_size, max_bytes) + 1)
        if len(data) > st.st_size:  # it grew since: the rest, up to the cap
            data += f.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise UntrustedInput(path, f"grew past the {max_bytes}-byte limit while being read")
    return data


class WarnOnce:
    """One warning per distinct message: readers that look again and again (each plan, each
    prune) name a refused file once, not at every look. Past `limit` messages it forgets them
    all, so a flood of bad files costs bounded memory."""

    def __init__(self, logger: logging.Logger, limit: int = 4096) -> None:
        self._log = logger
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, msg: str, *args: object) -> None:
        text = msg % args if args else msg
        if text in self._seen:
            return
        if len(self._seen) >= self._limit:
            self._seen.clear()
        self._seen.add(text)
        self._log.warning("%s", text)


def parse_json(path: str | os.PathLike[str], data: bytes) -> object:
    """JSON from bytes another process wrote; bad JSON (or deep nesting) is an UntrustedInput."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise UntrustedInput(path, f"is not valid JSON: {e}") from None


def read_json(
    path: str | os.PathLike[str],
    *,
    max_bytes: int,
    owners: Owners | None = None,
    dir_fd: int | None = None,
) -> object:
    return parse_json(path, read_bounded(path, max_bytes=max_bytes, owners=owners, dir_fd=dir_fd))


def relative_parts(name: str, *, what: str = "path") -> tuple[str, ...]:
    """The components of a relative path named by input; refuses absolute paths, `..`, empty or
    odd components (NUL, `.`), so that joining it to a base can never leave the base."""
    if not isinstance(name, str) or not name:
        raise UntrustedInput(repr(name), f"{what} must be a non-empty relative path")
    if "\x00" in name:
        raise UntrustedInput(repr(name), f"{what} contains a NUL byte")
    p = PurePosixPath(name)
    if p.is_absolute():
        raise UntrustedInput(
            name, f"{what} is absolute; only paths relative to their base are allowed"
        )
    parts = tuple(name.split("/"))
    for part in parts:
        if part in ("", ".", ".."):
            raise UntrustedInput(name, f"{what} has a '{part or '//'}' component; not allowed")
    return parts


def open_dir(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A descriptor of a directory, refusing a symlink in the last component."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            raise UntrustedInput(path, "is not a directory (or is a symlink)") from None
        raise open_error(path, e) from None


@contextlib.contextmanager
def walk_beneath(
    base_fd: int, parts: Iterable[str], *, create: bool = False, mode: int = 0o700
) -> Iterator[int]:
    """A descriptor of the directory base/parts..., walked without following any symlink;
    missing directories are made (with `mode`) when `create`."""
    fds: list[int] = []
    cur = base_fd
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode, dir_fd=cur)
            cur = open_dir(part, dir_fd=cur)
            fds.append(cur)
        yield cur
    finally:
        for fd in fds:
            os.close(fd)


def read_beneath(base_fd: int, name: str, *, max_bytes: int, owners: Owners | None = None) -> bytes:
    """Reads base/name where `name` came from input: confined to the base, no symlinks."""
    parts = relative_parts(name)
    with walk_beneath(base_fd, parts[:-1]) as d:
        return read_bounded(parts[-1], max_bytes=max_bytes, owners=owners, dir_fd=d)


def create_new(name: str, *, dir_fd: int, mode: int = 0o600) -> int:
    """Creates a file that did not exist (never opens a planted file or symlink)."""
    return os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        mode,
        dir_fd=dir_fd,
    )


def write_replace(
    dir_fd: int, name: str, data: bytes, *, mode: int = 0o644, fsync: bool = False
) -> None:
    """Writes dir/name so a reader sees the old file or the whole new one, never following a
    symlink planted at either the temp name or the final name (rename replaces the link)."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = create_new(tmp, dir_fd=dir_fd, mode=mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def write_file_nofollow(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """write_replace for a path: its directory is opened without following a symlink."""
    d = open_dir(path.parent)
    try:
        write_replace(d, path.name, data, mode=mode)
    finally:
        os.close(d)
