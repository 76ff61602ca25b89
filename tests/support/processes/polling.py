"""Waiting in tests for something another process or thread does: a bounded poll."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence


def wait_for(pred: Callable[[], bool], timeout: float = 20.0, step: float = 0.05) -> bool:
    """True once `pred()` holds, False if it still does not after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def catches_sigterm(pid: int) -> bool:
    """Whether the process has installed its own SIGTERM handler (the kernel's SigCgt mask): a
    diag process does so once its start-up imports are done, so a SIGTERM sent before then would
    kill it instead of stopping it cleanly. On a loaded machine that takes seconds."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (15 - 1)))
    except OSError:
        return False
    return False


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and its live children (0 when it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        total = sum(proc.cpu_times()[:2])
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(child.cpu_times()[:2])
        return total
    except psutil.Error:
        return 0.0


def idle_for(pids: Sequence[int], seconds: float = 1.0, cpu: float = 0.05) -> bool:
    """Whether the process trees of `pids` used under `cpu` seconds of CPU in `seconds`."""
    before = sum(tree_cpu_seconds(p) for p in pids)
    time.sleep(seconds)
    return sum(tree_cpu_seconds(p) for p in pids) - before < cpu
