"""The stop flag: a request that this rank save and leave at the next step boundary.

Signal handlers only set the flag (a handler runs between two bytecodes of the training thread:
it must not log, save or talk to other ranks). At step boundaries the training loop reads it and
the ranks agree on it with the three-byte flag all-reduce of `diag.trainer.commands.agree`, so a
signal that reached one rank stops every rank at the same step. The default signals are the ones
a worker gets told to go with: SIGTERM (Kubernetes, launchers), SIGINT, SIGUSR1 (DLRover on a
membership change) and SIGUSR2.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class StopRequest:
    reason: str  # "SIGTERM", ... or what the caller of request() said
    monotonic: float  # when it came (time.monotonic)


class StopFlag:
    """Set once by whoever asks first; read at step boundaries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request: StopRequest | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def request(self, reason: str) -> None:
        """Asks for a stop (the first reason is kept). Safe from any thread."""
        with self._lock:
            if self._request is None:
                self._request = StopRequest(reason, time.monotonic())

    @property
    def requested(self) -> StopRequest | None:
        return self._request

    def is_set(self) -> bool:
        return self._request is not None

    def clear(self) -> None:
        with self._lock:
            self._request = None

    def install(self, signals: tuple[signal.Signals, ...] = DRAIN_SIGNALS) -> None:
        """Makes `signals` set the flag instead of their usual effect (call from the main thread,
        where Python runs signal handlers). Idempotent; uninstall() puts the old handlers back."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "signal handlers can only be installed from the main thread: create the stop "
                "flag's handlers (or the graceful_exit callback) there"
            )
        for sig in signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        return tuple(self._previous)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # No lock here: the interrupted code may hold it. A racing request() can at worst lose
        # its reason to this one; the flag is set either way.
        if self._request is None:
            self._request = StopRequest(signal.Signals(signum).name, time.monotonic())


_flag = StopFlag()


def stop_flag() -> StopFlag:
    """The process's flag (signal handlers are per process, so is the flag)."""
    return _flag
