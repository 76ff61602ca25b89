"""A bench's own temp directory: torchrun makes a `torchelastic_*` directory under TMPDIR per run
and never removes it, so every bench that launches jobs points TMPDIR (for itself and all it
starts) at a directory it removes when it ends."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def private_tmpdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="diag-bench-tmp-")
    old_env, old_default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield path
    finally:
        tempfile.tempdir = old_default
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        shutil.rmtree(path, ignore_errors=True)
