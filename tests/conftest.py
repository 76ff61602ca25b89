"""Suite-wide setup."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

TMPDIR = "TMPDIR"
DLROVER_EVENTS = "DLROVER_EVENT_FILE_DIR"  # DLRover's training events, /tmp/dlrover by default


@pytest.fixture(scope="session", autouse=True)
def _private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every process the tests start writes its temp files under pytest's own temp directory
    (torchrun, for one, makes a `torchelastic_*` directory per run and never removes it), so
    they go away with pytest's old runs instead of piling up in /tmp. DLRover's training events
    (`events_sys_<rank>_<pid>.log`) go to /tmp/dlrover whatever TMPDIR says: its own variable
    sends them there too."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    saved = {k: os.environ.get(k) for k in (TMPDIR, DLROVER_EVENTS)}
    old_default = tempfile.tempdir
    os.environ[TMPDIR] = str(tmp)
    os.environ[DLROVER_EVENTS] = str(tmp / "dlrover-events")
    tempfile.tempdir = str(tmp)
    try:
        yield
    finally:
        tempfile.tempdir = old_default
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
