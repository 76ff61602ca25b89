"""Device-side timing of collectives on CUDA: event pairs polled by one watcher thread.

A start event is recorded on the current stream before the collective is issued (the collective
cannot begin before the work queued ahead of it). The end is the work's own device completion:
`Work.is_completed()`, which for NCCL queries the work's end event and never blocks, or an event
recorded after `Work.wait()` where a wait is seen, or, when the backend returns no work (it
synchronised the current stream at the C++ level, as `all_reduce(async_op=False)` lets it), an
event recorded right after the call. Waiting for a Python `Work.wait` alone was not enough: on an
H200 with torch 2.11 every sync op stayed STARTED, the poll list grew without bound and the agent
timed the first, long-finished collective as the hang. The watcher moves the journal record to STARTED and
COMPLETED as the device gets there. A rank whose kernel never finishes keeps a pending record
forever, which is exactly what the agent looks for.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from diag.formats.journalwriter import JournalWriter
from diag.formats.records import OpState

_POLL_S = 0.001
_MAX_UNWAITED = 4096  # works never waited on: forget the oldest beyond this many


@dataclass
class _Pending:
    seq: int
    start: Any
    work: Any = None  # held so its id is not reused while we poll it
    end: Any | None = None
    started: bool = False

    def finished(self) -> bool:
        if self.end is not None and self.end.query():
            return True
        if self.work is None:
            return False
        try:
            return bool(self.work.is_completed())
        except Exception:  # a backend without device completion: only the wait tells
            return False


class CudaEventTracker:
    def __init__(self, writer: JournalWriter) -> None:
        import torch

        self._torch = torch
        self._writer = writer
        self._by_work: dict[int, _Pending] = {}
        self._polling: list[_Pending] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="diag-cuda-events", daemon=True)
        self._thread.start()

    def record_start(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=False)
        ev.record()
        return ev

    def track(self, seq: int, work: Any, start: Any) -> None:
        p = _Pending(seq=seq, start=start, work=work)
        if work is None:
            # No work: the backend synchronised at the C++ level, so the current stream is
            # already ordered after the collective and an event here marks its end.
            p.end = self.record_start()
        with self._lock:
            self._polling.append(p)
            if work is not None:
                self._by_work[id(work)] = p
                if len(self._by_work) > _MAX_UNWAITED:
                    self._by_work.pop(next(iter(self._by_work)))

    def on_wait(self, work: Any) -> None:
        with self._lock:
            p = self._by_work.pop(id(work), None)
        if p is None:
            return
        ev = self._torch.cuda.Event(enable_timing=False)
        ev.record()
        p.end = ev

    def stop(self) -> None:
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            with self._lock:
                pending = list(self._polling)
            done = []
            for p in pending:
                now = time.monotonic_ns()
                if not p.started and p.start.query():
                    p.started = True
                    self._writer.update(p.seq, OpState.STARTED, t_start_ns=now)
                if p.started and p.finished():
                    self._writer.update(p.seq, OpState.COMPLETED, t_end_ns=now)
                    p.work = None
                    done.append(p)
            if done:
                with self._lock:
                    gone = {id(p) for p in done}
                    self._polling = [p for p in self._polling if id(p) not in gone]
