"""Completion of host-side (CPU backend) works.

A work completes when someone's `wait()` returns, which the patched `Work.wait` reports (sync ops
wait at once), or, for an async work nobody has waited on yet, when `is_completed()` turns true,
which a poller thread checks while any work is outstanding. The tracker holds the work objects,
so an id is never reused while we still map it to a journal record.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from diag.formats.journalwriter import JournalWriter
from diag.formats.records import OpState

_POLL_S = 0.05  # async works nobody waits on are seen complete within this


class HostWorkTracker:
    def __init__(self, writer: JournalWriter) -> None:
        self._writer = writer
        self._works: dict[int, tuple[int, Any]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, seq: int, work: Any) -> None:
        with self._lock:
            self._works[id(work)] = (seq, work)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._poll, name="diag-host-works", daemon=True
                )
                self._thread.start()
        if not self._wake.is_set():
            # The poller sleeps until there is work; once awake it polls every few ms until the
            # table is empty. Setting an already set event would cost ~3 us per op for nothing.
            self._wake.set()

    def on_wait(self, work: Any, failed: bool = False) -> None:
        if not self._works:
            return
        with self._lock:
            entry = self._works.pop(id(work), None)
        if entry is not None:
            state = OpState.FAILED if failed else OpState.COMPLETED
            self._writer.update(entry[0], state, t_end_ns=time.monotonic_ns())

    def _poll(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(_POLL_S)
            with self._lock:
                items = list(self._works.items())
            for key, (seq, work) in items:
                try:
                    done = work.is_completed()
                except Exception:
                    done = True
                if done:
                    with self._lock:
                        self._works.pop(key, None)
                    self._writer.update(seq, OpState.COMPLETED, t_end_ns=time.monotonic_ns())
            with self._lock:
                if not self._works:
                    self._wake.clear()
