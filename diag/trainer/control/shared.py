"""The process's one control client: started on first use by whichever part of the trainer asks
first (attach, a flash checkpointer), none when DIAG_CONTROL turns it off."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from diag.trainer.control.client import ControlClient
from diag.trainer.control.identity import ClientIdentity

CONTROL_ENV = "DIAG_CONTROL"  # "0" disables the client


def enabled() -> bool:
    return os.environ.get(CONTROL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_client: ControlClient | None = None
_client_lock = threading.Lock()


def shared_client(
    run_dir: Path, ident: ClientIdentity, *, journal: str = ""
) -> ControlClient | None:
    """The process's one control client (started on first use), or None when disabled."""
    global _client
    if not enabled():
        return None
    with _client_lock:
        if _client is None:
            _client = ControlClient(run_dir, ident, journal=journal).start()
        elif journal and not _client.journal:
            _client.journal = journal
        return _client
