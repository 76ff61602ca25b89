"""GPU health from NVML as taint evidence: XID events and uncorrected ECC errors.

`NvmlMonitor` listens for NVML's critical XID events on a thread of its own (blocking in
`nvmlEventSetWait` with a timeout, so it stops within a second) and reads each GPU's volatile
uncorrected ECC count every `ecc_interval` seconds. `poll(now)` hands the evidence to the agent's
health watch. Without an NVIDIA driver (or without a GPU) it starts nothing and says why in
`note`. The decoding of NVML's answers into evidence is pure (`xid_event`, `xid_evidence`,
`ecc_evidence`): plain data in, `Evidence` out.

Which XIDs taint, and which count as hardware faults, is the planner's decision (its policy);
this module reports every XID it sees.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from diag.agent.taint.model import Evidence, Signal

log = logging.getLogger(__name__)

# NVML's event type bit for critical XID errors (nvml.h: nvmlEventTypeXidCriticalError).
XID_CRITICAL_EVENT = 0x8
MAX_XIDS = 64  # XID events kept; a GPU in trouble can raise many of the same
WAIT_MS = 1000  # one nvmlEventSetWait: how long stopping the thread may take


@dataclass(frozen=True)
class XidEvent:
    gpu: int  # the device index, -1 when NVML could not tell which
    xid: int
    at: float  # unix time it was seen
    name: str = ""  # the GPU's model


@dataclass(frozen=True)
class EccReading:
    gpu: int
    uncorrected: int | None  # volatile (since the driver loaded); None: not supported
    name: str = ""


def xid_event(
    raw: Any, index_of: Callable[[Any], int], names: dict[int, str], at: float
) -> XidEvent | None:
    """One NVML event (what `nvmlEventSetWait` returns: `eventType`, `eventData`, `device`)
    as an XID event; None for events of other types."""
    if not int(raw.eventType) & XID_CRITICAL_EVENT:
        return None
    try:
        gpu = int(index_of(raw.device))
    except Exception:  # NVMLError of a device that is gone: the XID still counts
        gpu = -1
    return XidEvent(gpu=gpu, xid=int(raw.eventData), at=at, name=names.get(gpu, ""))


def xid_evidence(events: Iterable[XidEvent], now: float, memory: float) -> list[Evidence]:
    """The XIDs seen within the last `memory` seconds (0: all), one piece of evidence each."""
    return [
        Evidence(
            Signal.GPU_XID,
            e.at,
            e.name or "nvml",
            gpu=e.gpu if e.gpu >= 0 else None,
            xid=e.xid,
            incident_path="nvml",
        )
        for e in events
        if memory <= 0 or now - e.at <= memory
    ]


def ecc_evidence(readings: Iterable[EccReading], at: float) -> list[Evidence]:
    """A GPU with uncorrected ECC errors since the driver loaded is evidence."""
    return [
        Evidence(
            Signal.GPU_ECC,
            at,
            f"GPU {r.gpu} {r.name}".strip(),
            gpu=r.gpu,
            count=int(r.uncorrected),
            incident_path="nvml",
        )
        for r in readings
        if r.uncorrected
    ]


class NvmlMonitor:
    """The agent's GPU watch. `start()` returns at once; `poll(now)` is cheap (no NVML call)."""

    name = "gpu"

    def __init__(self, ecc_interval: float = 30.0, xid_memory: float = 0.0) -> None:
        self.ecc_interval = ecc_interval
        self.xid_memory = xid_memory
        self.note: str | None = None
        self._nv: Any = None
        self._handles: list[Any] = []
        self._names: dict[int, str] = {}
        self._events: Any = None
        self._xids: deque[XidEvent] = deque(maxlen=MAX_XIDS)
        self._ecc: tuple[EccReading, ...] = ()
        self._ecc_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if not self._open():
            log.info("GPU health not watched: %s", self.note)
            return
        self._read_ecc()
        self._thread = threading.Thread(target=self._run, name="diag-gpu-health", daemon=True)
        self._thread.start()
        log.info(
            "watching %d GPU(s) for XID events%s and uncorrected ECC errors",
            len(self._handles),
            "" if self._events is not None else " (unavailable)",
        )

    def _open(self) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
            self.note = f"no NVIDIA driver ({type(e).__name__})"
            return False
        nv = self._nv = pynvml
        try:
            count = nv.nvmlDeviceGetCount()
            for i in range(count):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                name = nv.nvmlDeviceGetName(h)
                self._handles.append(h)
                self._names[i] = name.decode() if isinstance(name, bytes) else str(name)
        except nv.NVMLError as e:
            self.note = f"NVML could not list the GPUs: {e}"
            self._close_nvml()
            return False
        if not self._handles:
            self.note = "no GPU"
            self._close_nvml()
            return False
        try:
            self._events = nv.nvmlEventSetCreate()
            for h in self._handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
        except nv.NVMLError as e:
            log.warning("NVML XID events unavailable (%s): only ECC counters are watched", e)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._events is None:
                self._stop.wait(self.ecc_interval)
            else:
                self._wait_xid()
            if time.monotonic() - self._ecc_at >= self.ecc_interval:
                self._read_ecc()

    def _wait_xid(self) -> None:
        nv = self._nv
        try:
            raw = nv.nvmlEventSetWait_v2(self._events, WAIT_MS)
        except nv.NVMLError as e:
            if getattr(e, "value", None) != nv.NVML_ERROR_TIMEOUT:
                log.warning("NVML event wait failed: %s", e)
                self._stop.wait(1.0)
            return
        event = xid_event(raw, nv.nvmlDeviceGetIndex, self._names, time.time())
        if event is not None:
            log.warning("GPU %d raised XID %d", event.gpu, event.xid)
            with self._lock:
                self._xids.append(event)

    def _read_ecc(self) -> None:
        readings = tuple(
            EccReading(i, self._uncorrected(h), self._names.get(i, ""))
            for i, h in enumerate(self._handles)
        )
        with self._lock:
            self._ecc = readings
        self._ecc_at = time.monotonic()

    def _uncorrected(self, handle: Any) -> int | None:
        nv = self._nv
        try:
            return int(
                nv.nvmlDeviceGetTotalEccErrors(
                    handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                )
            )
        except nv.NVMLError:  # ECC off or not supported on this part
            return None

    def poll(self, now: float) -> tuple[Evidence, ...]:
        with self._lock:
            xids, ecc = list(self._xids), self._ecc
        return (*xid_evidence(xids, now, self.xid_memory), *ecc_evidence(ecc, now))

    def readings(self) -> tuple[EccReading, ...]:
        with self._lock:
            return self._ecc

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WAIT_MS / 1000 + 5)
            self._thread = None
        self._close_nvml()

    def _close_nvml(self) -> None:
        nv = self._nv
        if nv is None:
            return
        if self._events is not None:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(self._events)
            self._events = None
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()
        self._nv = None


def probe(
    watch_seconds: float, now: Callable[[], float] = time.time
) -> tuple[list[Evidence], str | None]:
    """For `diag taint`: ECC counts now, and the XIDs raised while it watches `watch_seconds`
    (NVML reports XID events as they happen, not those raised before it listened). The note
    says why nothing was read."""
    monitor = NvmlMonitor(ecc_interval=max(watch_seconds, 1.0))
    if not monitor._open():
        return [], f"{monitor.note}: GPU health not read"
    try:
        monitor._read_ecc()
        deadline = time.monotonic() + watch_seconds
        while monitor._events is not None and time.monotonic() < deadline:
            monitor._wait_xid()
        return list(monitor.poll(now())), None
    finally:
        monitor.close()
