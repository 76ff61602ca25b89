"""The threads grpc starts for the control channel, found by what they run.

A streaming call starts a channel poller thread that runs only grpc's frames, so nothing in a
stack dump says it is diag's: the journal meta does, once these are found.
"""

from __future__ import annotations

import os
import sys
import threading
import time

_SPIN_FILE = os.path.join("grpc", "_channel.py")
_SPIN_FUNC = "channel_spin"
SPIN_WAIT_S = 1.0


def channel_threads_since(before: set[int | None], wait_s: float = SPIN_WAIT_S) -> list[int]:
    """Native ids of the threads started since `before` (thread idents) that run grpc's
    channel poller (`_run_channel_spin_thread`). A streaming call starts one for its channel; it
    runs only grpc's frames, so nothing in a stack dump says it is diag's: the journal meta
    does. Waits up to `wait_s` for a new thread to reach the poller."""
    deadline = time.monotonic() + wait_s
    while True:
        fresh = [t for t in threading.enumerate() if t.ident not in before]
        frames = sys._current_frames()
        found = []
        for t in fresh:
            f = frames.get(t.ident)  # type: ignore[arg-type]
            while f is not None:
                code = f.f_code
                if code.co_name == _SPIN_FUNC and code.co_filename.endswith(_SPIN_FILE):
                    if t.native_id:
                        found.append(t.native_id)
                    break
                f = f.f_back
        if found or not fresh or time.monotonic() >= deadline:
            return found
        time.sleep(0.01)
