"""Whether this process failed: an uncaught exception is noted, so that a flash checkpointer
closing at exit keeps its snapshots (the agent persists them, a restart loads them)."""

from __future__ import annotations

import sys
from typing import Any

_failed = False
_watching = False


def failed() -> bool:
    return _failed


def watch() -> None:
    """Notes an uncaught exception, so that closing at exit keeps the snapshots."""
    global _watching
    if _watching:
        return
    _watching = True
    previous = sys.excepthook

    def hook(tp: Any, value: Any, tb: Any) -> None:
        global _failed
        _failed = True
        previous(tp, value, tb)

    sys.excepthook = hook
