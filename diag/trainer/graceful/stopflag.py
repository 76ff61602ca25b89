"""The stop flag: a request that this rank save and leave at the next step boundary.

Who asks: a signal (below), a stop file (a path any process can create, checked at agreements),
or code calling `request()`.

Signal handlers only set the flag (a handler runs between two bytecodes of the training thread:
it must not log, save or talk to other ranks). At step boundaries the training loop reads it and
the ranks agree on it with the three-byte flag all-reduce of `diag.trainer.control.commands.agree`, so a
signal that reached one rank stops every rank at the same step. The default signals are the ones
a worker gets told to go with: SIGTERM (Kubernetes, launchers), SIGINT, SIGUSR1 (DLRover on a
membership change) and SIGUSR2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.trainer.control.period import DEFAULT_MAX_LATENCY_S, DEFAULT_MAX_OVERHEAD, PeriodPolicy

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# What a rank that saved and left on a stop request exits with: 128 + SIGTERM, the status of a
# process ended by SIGTERM. Launchers take any non-zero status as a failure and restart the
# workers (torchrun, dlrover-run with --max-restarts) or exit with it (the deepspeed launcher);
# DLRover's master reads 143 as "killed" (relaunch, not a code error), Kubeflow's ExitCode
# restart policy as retryable (128-255).
DRAIN_EXIT_CODE = 143
STOP_FILE_ENV = "DIAG_STOP_FILE"
MAX_LATENCY_ENV = "DIAG_STOP_MAX_LATENCY"
OVERHEAD_ENV = "DIAG_STOP_MAX_OVERHEAD"
EVERY_ENV = "DIAG_STOP_EVERY"
EXIT_CODE_ENV = "DIAG_DRAIN_EXIT_CODE"


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
        # When the main thread last ran a drain signal's Python handler (time.monotonic): the
        # stuck-drain watch tells a rank blocked in C by its absence.
        self.handled_at: float | None = None

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
        self.handled_at = time.monotonic()
        if self._request is None:
            self._request = StopRequest(signal.Signals(signum).name, time.monotonic())


_flag = StopFlag()


def stop_flag() -> StopFlag:
    """The process's flag (signal handlers are per process, so is the flag)."""
    return _flag


class StopFlagSettingsError(ValueError):
    pass


@dataclass(frozen=True)
class StopFlagSettings:
    stop_file: Path | None  # None: no stop file
    period: PeriodPolicy
    exit_code: int = DRAIN_EXIT_CODE

    @classmethod
    def resolve(
        cls,
        *,
        stop_file: str | os.PathLike[str] | None = None,
        max_latency_s: float | None = None,
        max_overhead: float | None = None,
        every: int | None = None,
        exit_code: int | None = None,
        run_dir: Path | None = None,
        env: Mapping[str, str] = os.environ,
    ) -> StopFlagSettings:
        """Arguments first, then the environment, then the defaults (the stop file defaults to
        `<run dir>/stop`; an empty DIAG_STOP_FILE turns it off)."""
        if stop_file is None:
            if STOP_FILE_ENV in env:
                stop_file = env[STOP_FILE_ENV] or None
            elif run_dir is not None:
                stop_file = run_dir / "stop"
        latency = _pick(max_latency_s, env, MAX_LATENCY_ENV, float, DEFAULT_MAX_LATENCY_S)
        overhead = _pick(max_overhead, env, OVERHEAD_ENV, float, DEFAULT_MAX_OVERHEAD)
        fixed = _pick(every, env, EVERY_ENV, int, None)
        code = _pick(exit_code, env, EXIT_CODE_ENV, int, DRAIN_EXIT_CODE)
        if not 1 <= code <= 255:
            raise StopFlagSettingsError(
                f"the drain exit code must be in 1..255 (0 would read as success and stop the "
                f"launcher from restarting the workers), not {code}"
            )
        try:
            period = PeriodPolicy(max_latency_s=latency, max_overhead=overhead, every=fixed)
        except ValueError as e:
            raise StopFlagSettingsError(
                f"{e} (set by argument or {MAX_LATENCY_ENV}/{OVERHEAD_ENV}/{EVERY_ENV})"
            ) from None
        return cls(Path(stop_file) if stop_file else None, period, code)


def _pick(value: Any, env: Mapping[str, str], name: str, kind: type, default: Any) -> Any:
    if value is not None:
        return value
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise StopFlagSettingsError(
            f"{name}={raw!r} is not a valid {kind.__name__}: fix or unset it"
        ) from None


def stop_file_present(path: Path | None) -> bool:
    return path is not None and path.exists()


def consume_stop_file(path: Path | None) -> None:
    """Removes the stop file once its request was honoured, so the restarted workers run on."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
