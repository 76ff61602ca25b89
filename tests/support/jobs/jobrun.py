"""Launching test jobs under torchrun on this machine: a free port, the command line, and a run
that is always reaped (its whole process tree stopped when it outlives its time)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from diag.agent.observe.procs import stop_tree

# Ports handed out below the kernel's ephemeral range (32768-60999 by default): a port the
# kernel picks for port 0 can be taken as the source port of any connection (gloo opens many)
# between the test's probe and the job's bind. Each parallel worker gets its own slice.
_PORTS = range(20000, 32000)
_handed: set[int] = set()


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    size = len(_PORTS) // count
    first = _PORTS.start + (index % count) * size
    start = random.randrange(size)
    for i in range(size):
        port = first + (start + i) % size
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:  # the slice is used up: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(nproc: int, script: str | os.PathLike[str], *args: str) -> list[str]:
    """One node, `nproc` ranks, no restarts: a failed rank fails the launch."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
        str(script), *args,
    ]  # fmt: skip


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts `cmd` in a session of its own, its output (both streams) in `log`."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(proc: subprocess.Popen) -> None:
    """Stops `proc` and its whole tree (torchrun's ranks run in sessions of their own) if it
    still runs, and reaps it."""
    if proc.poll() is None:
        stop_tree(proc.pid, grace=5)
        proc.wait(10)


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    """Waits for `proc`; whatever happens, leaves no process of its tree behind."""
    try:
        return proc.wait(timeout)
    finally:
        stop(proc)


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 300) -> int:
    return finish(start(cmd, log, env), timeout)
