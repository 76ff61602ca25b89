"""PyTorch's flight recorder, served to the agent from inside the rank.

torch records the last collectives of every process group (gloo and NCCL) in a ring, the flight
recorder. The agent takes it as evidence of a hang, when the training thread is stuck. Of the
ways torch offers to dump it:
- `_dump_fr_trace_json()` / `_dump_nccl_trace_json()` are Python calls: they need the GIL, which
  a training thread stuck in a native call that holds it never gives back;
- the NCCL watchdog's pipe (`TORCH_NCCL_DEBUG_INFO_PIPE_FILE`) needs no GIL, but its dump is a
  pickle (`DebugInfoWriter` writes `dump_nccl_trace()`), which the agent must never load, and
  it exists for NCCL only;
- torch's worker server (`_WorkerServer`, the one `TORCH_WORKER_SERVER_SOCKET` starts) answers
  HTTP on a unix socket from its own C++ thread, without the GIL, with JSON: `fr_trace_json`
  (the gloo and CPU side) and `dump_nccl_trace_json` (NCCL, on CUDA builds).
So each rank serves the worker server on a socket beside its journal, in the run directory (which
only the rank's user can enter), and the agent asks it. The agent checks that the process at the
other end is the rank (SO_PEERCRED) before it believes the answer.

Both sides name the socket from the journal path alone: nothing read from a meta decides where
the agent connects (`diag.formats.frsocket`). Never imports the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from diag.formats.frsocket import socket_path

log = logging.getLogger(__name__)

# Ring size when the job sets none. torch reads it once, when the first process group is made.
DEFAULT_BUFFER = 2000
BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enable_buffer(env: MutableMapping[str, str] = os.environ) -> bool:
    """Makes sure the ring records (a size of 0 turns it off); True when the job had not set
    it. Too late once a process group exists: torch read it then."""
    if any(k in env for k in BUFFER_ENV):
        return False
    for k in BUFFER_ENV:
        env[k] = str(DEFAULT_BUFFER)
    return True


class FlightRecorderServer:
    """torch's worker server on `socket_path(journal)`, made 0600 and renamed into place, so no
    other user connects and the agent never finds a half-made socket."""

    def __init__(self, server: Any, path: Path) -> None:
        self._server = server
        self.path = path

    @classmethod
    def start(cls, journal: Path) -> FlightRecorderServer | None:
        """None when this torch has no worker server (or it could not listen): the incident
        then says the rank's flight recorder could not be taken."""
        try:
            from torch._C._distributed_c10d import _WorkerServer
        except ImportError as e:
            log.info("diag: no flight recorder server in this torch (%s)", e)
            return None
        path = socket_path(journal)
        tmpdir = Path(tempfile.mkdtemp(prefix=".fr-", dir=path.parent))
        tmp = tmpdir / "s"
        try:
            server = _WorkerServer(str(tmp))
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except (RuntimeError, OSError) as e:
            log.warning("diag: cannot serve the flight recorder on %s: %s", path, e)
            return None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
            with contextlib.suppress(OSError):
                tmpdir.rmdir()
        return cls(server, path)

    def close(self) -> None:
        if self._server is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(RuntimeError):
            self._server.shutdown()
        self._server = None
