"""The adapter of diag.trainer.graceful.abandon: a rank that cannot drain leaves when told to go.

Python runs a signal's handler in the main thread, between two bytecodes: a rank blocked in a C
call (a gloo collective waiting on a hung peer) runs it only when the call returns, and even then
the handler only sets the stop flag. So:

- `signal.set_wakeup_fd` makes CPython's C-level handler write the signal's number to a socket
  as it arrives; a daemon thread waits on the other end, sets the flag itself and applies the
  rule (the blocked main thread has released the GIL, so the thread runs). When the rule says
  leave, it flushes the logs and stdio and ends the process with `os._exit`: nothing that could
  wait on the stuck collective runs.
- At exit (an error ended the loop, or the script's end) the drain is over: the exit hook puts
  back the signals' previous handlers, so a SIGTERM that comes later has its usual effect, and
  a request that came before it makes the process leave right after the exit handlers, without
  finalizing the interpreter (tearing down a torch/DeepSpeed heap took 7-9 s on a loaded 2-core
  machine, while the launcher waits).
- GracefulExit reports agreements and barriers that raise (a peer gone) and leaves at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from diag.trainer.graceful.abandon import (
    DEFAULT_POLICY,
    AbandonPolicy,
    Action,
    DrainProgress,
    Phase,
    Verdict,
    decide,
)
from diag.trainer.graceful.stopflag import StopFlag

log = logging.getLogger(__name__)

IDLE_POLL_S = 5.0  # a wake-up without a signal costs nothing; this only bounds a lost one


class DrainWatch:
    """One rank's progress through a drain, and the thread that acts on the rule."""

    def __init__(
        self,
        flag: StopFlag,
        step_seconds: Callable[[], float | None],
        exit_code: int,
        policy: AbandonPolicy = DEFAULT_POLICY,
    ) -> None:
        self.flag = flag
        self.step_seconds = step_seconds
        self.exit_code = exit_code
        self.policy = policy
        self.phase = Phase.TRAINING
        self.agreement_failed = False
        # A drain signal read from the wake-up socket came after this moment (the previous read).
        self.signal_after: float | None = None
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._signals: frozenset[int] = frozenset()

    # -- what the training loop reports -----------------------------------------------------------

    def progress(self) -> DrainProgress:
        request = self.flag.requested
        return DrainProgress(
            requested_at=request.monotonic if request else None,
            phase=self.phase,
            step_s=self.step_seconds(),
            agreement_failed=self.agreement_failed,
            unhandled_since=self._unhandled_since(),
        )

    def _unhandled_since(self) -> float | None:
        # A handler run after the previous read ran for this signal or a later one: either way
        # the main thread executed Python since the signal may have come.
        after, handled = self.signal_after, self.flag.handled_at
        if after is None or (handled is not None and handled > after):
            return None
        return after

    def verdict(self) -> Verdict:
        return decide(self.progress(), time.monotonic(), self.policy)

    # -- the thread ------------------------------------------------------------------------------

    def start(self, signals: tuple[signal.Signals, ...]) -> bool:
        """Routes `signals` to the watching thread as well (call from the main thread, after the
        flag's handlers are installed). False when another wake-up fd is set (an asyncio loop's,
        say): it is left alone, and a rank blocked in C then learns of a signal only when the
        call returns."""
        if not signals:
            return False
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous not in (-1, _installed_fd()):
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            log.info("diag: a signal wake-up fd is already set; the stuck-drain watch is off")
            return False
        _set_installed_fd(writer.fileno())
        self._reader, self._writer = reader, writer
        self._signals = frozenset(int(s) for s in signals)
        threading.Thread(target=self._run, name="diag-drain-watch", daemon=True).start()
        return True

    def _run(self) -> None:
        reader = self._reader
        assert reader is not None
        timeout: float | None = IDLE_POLL_S
        previous_read = time.monotonic()
        while True:
            try:
                ready, _, _ = select.select([reader], [], [], timeout)
                data = reader.recv(64) if ready else b""
            except OSError:
                return  # closed at exit
            for signum in data:
                if signum in self._signals:
                    self.flag.request(signal.Signals(signum).name)
                    if self._unhandled_since() is None:
                        self.signal_after = previous_read
            previous_read = time.monotonic()
            verdict = self.verdict()
            if verdict.action is Action.LEAVE_NOW and self.phase is not Phase.LEAVING:
                self.leave(verdict.reason)
            timeout = verdict.recheck_s if verdict.recheck_s is not None else IDLE_POLL_S

    def leave(self, reason: str) -> NoReturn:
        """Ends the process now with the drain's exit code, without a save and without running
        anything that could wait on a peer."""
        log.error("diag: leaving without a save (%s); exit code %d", reason, self.exit_code)
        flush_output()
        os._exit(self.exit_code)

    # -- at exit ---------------------------------------------------------------------------------

    def at_exit(self) -> str | None:
        """No drain can happen any more: unless one was done, puts the signals' handlers back
        and stops routing them here.
        Returns why the process must leave without finalizing (a request came and was not
        honoured), or None."""
        if self.phase is Phase.DONE:
            return None  # drained: leaving with its code; a late SIGTERM must not change that
        self.phase = Phase.LEAVING
        verdict = self.verdict()
        self.flag.uninstall()
        if self._writer is not None and _installed_fd() == self._writer.fileno():
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(-1)
            _set_installed_fd(-1)
        if verdict.action is Action.LEAVE_NOW:
            return verdict.reason
        return None


def flush_output() -> None:
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


_wakeup_fd = -1


def _installed_fd() -> int:
    return _wakeup_fd


def _set_installed_fd(fd: int) -> None:
    global _wakeup_fd
    _wakeup_fd = fd
