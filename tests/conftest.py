"""Suite-wide setup."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every process the tests start writes its temp files under pytest's own temp directory
    (torchrun, for one, makes a `torchelastic_*` directory per run and never removes it), so
    they go away with pytest's old runs instead of piling up in /tmp."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    old_env, old_default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    try:
        yield
    finally:
        tempfile.tempdir = old_default
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
