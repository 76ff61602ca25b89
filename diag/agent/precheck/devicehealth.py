"""GPU health from NVML: memory already in use, ECC, row remapping, temperature, and XID events
raised while the precheck runs. Without an NVIDIA driver every check here is skipped with a note.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Any

from diag.agent.precheck.measurements import DeviceHealth

log = logging.getLogger(__name__)


class NvmlWatch:
    """`start()` snapshots every GPU and begins listening for XID events; `finish()` returns the
    devices with the XIDs seen meanwhile. Snapshot before our own matmuls allocate memory."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._events: Any = None
        self._snapshot: list[DeviceHealth] = []
        self.note: str | None = None

    def start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
            self.note = f"no NVIDIA driver ({type(e).__name__}): device health skipped"
            return
        self._nvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            self.note = "no GPU: device health skipped"
            return
        try:
            self._events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            log.info("NVML events unavailable (%s): XID errors will not be seen", e)
        for i in range(count):
            self._snapshot.append(self._probe(i))

    def _probe(self, index: int) -> DeviceHealth:
        nv = self._nvml
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            name = nv.nvmlDeviceGetName(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
        except nv.NVMLError as e:
            return DeviceHealth(index=index, error=str(e))
        if self._events is not None:
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
            except nv.NVMLError as e:
                log.info("GPU %d: cannot watch XID events (%s)", index, e)
        return DeviceHealth(
            index=index,
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_used_fraction=mem.used / mem.total if mem.total else None,
            ecc_uncorrected=self._optional(
                nv.nvmlDeviceGetTotalEccErrors,
                h,
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            ),
            remap_failed=self._remap_failed(h),
            temperature_c=self._optional(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
        )

    def _optional(self, fn: Any, *args: Any) -> Any:
        """A value the part may not support (ECC on consumer cards): None when unsupported."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _remap_failed(self, handle: Any) -> bool | None:
        rows = self._optional(self._nvml.nvmlDeviceGetRemappedRows, handle)
        return bool(rows[3]) if rows else None

    def finish(self) -> tuple[DeviceHealth, ...]:
        if self._nvml is None:
            return ()
        nv = self._nvml
        xids: dict[int, list[int]] = {}
        if self._events is not None:
            while True:
                try:
                    ev = nv.nvmlEventSetWait_v2(self._events, 0)
                except nv.NVMLError:  # NVML_ERROR_TIMEOUT: no more events
                    break
                try:
                    index = nv.nvmlDeviceGetIndex(ev.device)
                except nv.NVMLError:
                    index = -1
                xids.setdefault(index, []).append(int(ev.eventData))
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(self._events)
        out = []
        for d in self._snapshot:
            seen = tuple(xids.get(d.index, ()))
            out.append(replace(d, xid_errors=seen) if seen else d)
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()
        return tuple(out)
