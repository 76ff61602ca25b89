"""GPU metrics through NVML (`pynvml` from the nvidia-ml-py package), read at scrape time.

Hosts without an NVIDIA driver have no NVML library: `open_nvml()` then returns None, says so at
debug level, and the GPU families are simply absent. XID errors arrive as NVML events; a daemon
thread waits for them and counts them per GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from diag.agent.metrics import families as f

log = logging.getLogger(__name__)

_EVENT_WAIT_MS = 1000


@dataclass(frozen=True)
class GpuReading:
    index: int
    utilization: float | None  # 0..1
    memory_used: int | None
    memory_total: int | None
    temperature: float | None  # Celsius
    power: float | None  # watts
    ecc_corrected: int | None  # None when ECC is off or unsupported
    ecc_uncorrected: int | None
    xid_errors: int = 0
    last_xid: int = 0


class Nvml:
    """The NVML session of the agent: device handles, readings, and the XID event thread."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.handles = [
            nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())
        ]
        self._lock = threading.Lock()
        self._xids: dict[int, tuple[int, int]] = {i: (0, 0) for i in range(len(self.handles))}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_events()

    def _start_events(self) -> None:
        n = self.nvml
        try:
            events = n.nvmlEventSetCreate()
            for h in self.handles:
                try:
                    n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, events)
                except n.NVMLError as e:
                    log.info("XID events unavailable on a GPU: %s", e)
        except n.NVMLError as e:
            log.info("NVML events unavailable, XID errors will not be counted: %s", e)
            return
        self._thread = threading.Thread(
            target=self._watch, args=(events,), name="diag-nvml-xid", daemon=True
        )
        self._thread.start()

    def _watch(self, events: Any) -> None:
        n = self.nvml
        try:
            while not self._stop.is_set():
                try:
                    data = n.nvmlEventSetWait_v2(events, _EVENT_WAIT_MS)
                except n.NVMLError_Timeout:
                    continue
                except n.NVMLError as e:
                    log.warning("NVML event wait failed, no more XID counting: %s", e)
                    return
                try:
                    index = n.nvmlDeviceGetIndex(data.device)
                except n.NVMLError:
                    continue
                xid = int(data.eventData)
                log.warning("GPU %d reported XID %d", index, xid)
                with self._lock:
                    count, _ = self._xids.get(index, (0, 0))
                    self._xids[index] = (count + 1, xid)
        finally:
            n.nvmlEventSetFree(events)

    def read(self) -> list[GpuReading]:
        n = self.nvml
        out = []
        for i, h in enumerate(self.handles):
            util = self._try(lambda h=h: n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
            mem = self._try(lambda h=h: n.nvmlDeviceGetMemoryInfo(h))
            temp = self._try(
                lambda h=h: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
            )
            power = self._try(lambda h=h: n.nvmlDeviceGetPowerUsage(h) / 1000.0)  # milliwatts
            ecc = [
                self._try(
                    lambda h=h, t=t: int(n.nvmlDeviceGetTotalEccErrors(h, t, n.NVML_VOLATILE_ECC))
                )
                for t in (n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
            ]
            with self._lock:
                xids, last = self._xids.get(i, (0, 0))
            out.append(
                GpuReading(
                    index=i,
                    utilization=util,
                    memory_used=mem.used if mem is not None else None,
                    memory_total=mem.total if mem is not None else None,
                    temperature=temp,
                    power=power,
                    ecc_corrected=ecc[0],
                    ecc_uncorrected=ecc[1],
                    xid_errors=xids,
                    last_xid=last,
                )
            )
        return out

    def _try(self, read: Any) -> Any:
        try:
            return read()
        except self.nvml.NVMLError:
            return None  # not supported on this GPU, or it fell off the bus

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _EVENT_WAIT_MS / 1000)
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


def open_nvml() -> Nvml | None:
    try:
        import pynvml
    except ImportError:
        log.debug("no GPU metrics: the nvidia-ml-py package is not installed")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.debug("no GPU metrics: NVML is unavailable (%s)", e)
        return None
    try:
        return Nvml(pynvml)
    except pynvml.NVMLError as e:
        log.warning("no GPU metrics: NVML failed to list devices: %s", e)
        return None


class GpuCollector(Collector):
    def __init__(self, node: str, nvml: Nvml) -> None:
        self.node = node
        self.nvml = nvml

    def collect(self) -> Iterator[Metric]:
        yield from gpu_families(self.node, self.nvml.read())


def gpu_families(node: str, readings: list[GpuReading]) -> Iterator[Metric]:
    """The GPU families from readings (plain data in, families out)."""
    fams = {
        fam.name: fam.new()
        for fam in (
            f.GPU_UTIL,
            f.GPU_MEM_USED,
            f.GPU_MEM_TOTAL,
            f.GPU_TEMP,
            f.GPU_POWER,
            f.GPU_XID,
            f.GPU_LAST_XID,
            f.GPU_ECC,
        )
    }
    for g in readings:
        labels = [node, str(g.index)]
        for fam, value in (
            (f.GPU_UTIL, g.utilization),
            (f.GPU_MEM_USED, g.memory_used),
            (f.GPU_MEM_TOTAL, g.memory_total),
            (f.GPU_TEMP, g.temperature),
            (f.GPU_POWER, g.power),
            (f.GPU_XID, g.xid_errors),
            (f.GPU_LAST_XID, g.last_xid),
        ):
            if value is not None:
                fams[fam.name].add_metric(labels, value)
        for kind, value in (("corrected", g.ecc_corrected), ("uncorrected", g.ecc_uncorrected)):
            if value is not None:
                fams[f.GPU_ECC.name].add_metric([*labels, kind], value)
    yield from fams.values()
