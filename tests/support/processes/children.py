"""Stopping the processes a test started: SIGTERM, a wait, then SIGKILL; trainer jobs by their
whole process tree (torchrun and its ranks)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable

from diag.agent.observe.procs import stop_tree


def terminate(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM `proc` if it still runs and reap it; SIGKILL it if it outlives `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def stop_jobs_and_agents(
    jobs: Iterable[subprocess.Popen], agents: Iterable[subprocess.Popen]
) -> None:
    """Jobs first (by process tree, so no rank is left behind), then their agents."""
    for p in jobs:
        if p.poll() is None:
            stop_tree(p.pid, grace=5)
        p.wait(timeout=30)
    for a in agents:
        terminate(a)
