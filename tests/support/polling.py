"""Waiting in tests for something another process or thread does: a bounded poll."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(pred: Callable[[], bool], timeout: float = 20.0, step: float = 0.05) -> bool:
    """True once `pred()` holds, False if it still does not after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()
