"""The node's worker processes and warm spares, as `diag launch` starts, watches and stops them.

A worker is a process holding a rank: started cold (`python -u script args` with the rank's
environment, as torchrun starts it) or a warm spare told to take the rank. Each runs in a
session of its own (as torchrun's workers do), so that a signal to the launcher's terminal does
not reach it twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from diag.launch.spare import READY_FD_ENV, Order

log = logging.getLogger(__name__)

SPARE_DEATHS = 3  # spares that die waiting before the launcher stops starting them


@dataclass
class Proc:
    """One worker: the process holding a rank now, and what the policy needs to know of it."""

    local_rank: int
    rank: int
    env: dict[str, str]  # the rank's own variables (over the launcher's environment)
    popen: subprocess.Popen[bytes]
    started_at: float  # when it took the rank (monotonic)
    replacement: bool = False
    replacements: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid


def start_cold(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-u", *argv], env={**os.environ, **env}, start_new_session=True
    )


@dataclass
class Spares:
    """The node's warm spares: `size` processes importing torch, DeepSpeed and diag, then
    waiting for an order. One taken is replaced in the background (started now; it imports
    while the job trains)."""

    size: int
    waiting: list[subprocess.Popen[bytes]] = field(default_factory=list)
    died: int = 0  # spares that exited without an order
    _ready_fds: dict[int, int] = field(default_factory=dict)  # pid -> read end of its ready pipe
    _warm: set[int] = field(default_factory=set)  # pids of spares done importing

    def fill(self) -> None:
        for p in self.waiting:
            if p.poll() is not None:
                self.died += 1
                log.warning("diag launch: a spare exited with %s before it took a rank",
                            p.returncode)  # fmt: skip
        self.waiting = [p for p in self.waiting if p.poll() is None]
        self._forget_gone()
        if self.died >= SPARE_DEATHS and self.size:  # not a loop of processes that die at once
            log.warning("diag launch: %d spares died waiting: no more spares (a replacement "
                        "is a new process)", self.died)  # fmt: skip
            self.size = 0
        while len(self.waiting) < self.size:
            cmd = [sys.executable, "-u", "-m", "diag.launch.spare"]
            r, w = os.pipe()
            os.set_blocking(r, False)
            try:
                p = subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, start_new_session=True, pass_fds=(w,),
                    env={**os.environ, READY_FD_ENV: str(w)},
                )  # fmt: skip
            except BaseException:
                os.close(r)
                raise
            finally:
                os.close(w)
            self._ready_fds[p.pid] = r
            self.waiting.append(p)

    def ready(self) -> int:
        return sum(1 for p in self.waiting if p.poll() is None)

    def warm(self) -> int:
        """Spares alive that said their imports are done."""
        for pid, fd in list(self._ready_fds.items()):
            try:
                said = os.read(fd, 1)
            except BlockingIOError:
                continue  # still importing
            except OSError:
                said = b""
            if said:
                self._warm.add(pid)
            os.close(fd)  # said it, or closed the pipe without a word (it died)
            del self._ready_fds[pid]
        return sum(1 for p in self.waiting if p.poll() is None and p.pid in self._warm)

    def _forget_gone(self) -> None:
        alive = {p.pid for p in self.waiting}
        for pid in [pid for pid in self._ready_fds if pid not in alive]:
            os.close(self._ready_fds.pop(pid))
        self._warm &= alive

    def take(self, order: Order) -> subprocess.Popen[bytes] | None:
        """A spare that took `order`, or None when none is alive (or none accepted it). A warm
        one first."""
        self.warm()
        self.waiting.sort(key=lambda p: p.pid not in self._warm)
        while self.waiting:
            p = self.waiting.pop(0)
            self._forget_gone()
            if p.poll() is not None or p.stdin is None:
                continue
            try:
                p.stdin.write(order.encode())
                p.stdin.close()
            except OSError as e:  # it died between the poll and the write
                log.info("diag launch: a spare did not take the order (%s)", e)
                stop([p], grace=1.0)
                continue
            return p
        return None

    def close(self, grace: float) -> None:
        """Stops the spares: a closed pipe ends a waiting spare (exit 0); a signal the rest."""
        for p in self.waiting:
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()
        stop(self.waiting, grace)
        self.waiting = []
        self._forget_gone()


def stop(procs: list[subprocess.Popen[bytes]], grace: float, sig: int = signal.SIGTERM) -> None:
    """Signals each running process, waits up to `grace` seconds for all, then kills the rest.
    Each is reaped."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
    deadline = time.monotonic() + grace
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in running:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
