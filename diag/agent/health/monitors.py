"""The node's own health, watched by the agent as node-problem-detector watches a node: each
monitor turns one source into typed `Evidence`, the pure planner (`planner.py`) decides, and the
Kubernetes adapter (`kube.py`) applies. `watch.py` polls the monitors and plans when the
evidence says something new.

Monitors:
- `NicMonitor`: the carrier of the configured interfaces, from sysfs. A NIC counts once it has
  been without carrier for `grace` seconds (a link that comes back within it is not a fault); an
  interface that was there and is gone counts too;
- `PrecheckMonitor`: the report `diag precheck --report` wrote (read again when it changes): a
  `faulty` verdict for this node, its GPUs' ECC/XID findings and its NIC, or a clean precheck;
- `gpuhealth.NvmlMonitor`: NVML's XID events and ECC counters, on a thread of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from diag.agent.node.nic import SYSFS_NET, link_state
from diag.agent.taint.evidencesources import from_precheck_report
from diag.agent.taint.model import Evidence, Signal
from diag.agent.taint.taintconfig import HealthSettings
from diag.formats.exitcodes import UsageError

log = logging.getLogger(__name__)


class Monitor(Protocol):
    name: str

    def start(self) -> None: ...

    def poll(self, now: float) -> tuple[Evidence, ...]:
        """The evidence this source holds now (empty: nothing wrong that it can see)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LinkReading:
    iface: str
    present: bool  # False: the interface was there before and is gone
    carrier: bool | None  # None: the kernel does not say
    operstate: str | None = None


@dataclass(frozen=True)
class LinkDown:
    since: float  # when the carrier was first seen missing
    state: str  # how it looked then, for the evidence line


def carrier_evidence(
    readings: Sequence[LinkReading], down: Mapping[str, LinkDown], now: float, grace: float
) -> tuple[dict[str, LinkDown], list[Evidence]]:
    """Pure: the links without carrier now (with when they went down), and the evidence of
    those down for `grace` seconds or more. Its line stays the same while the link stays down,
    so the planner sees the same fault, not a new one per look."""
    still: dict[str, LinkDown] = {}
    out: list[Evidence] = []
    for r in readings:
        if r.present and r.carrier is not False:
            continue
        # Not the operstate: it moves (down, lowerlayerdown, dormant) while the carrier stays
        # away, and the line must stay the same for as long as the fault does.
        state = "no carrier" if r.present else "gone"
        d = still[r.iface] = down.get(r.iface) or LinkDown(now, state)
        if now - d.since >= grace:
            out.append(
                Evidence(
                    Signal.NIC_NO_CARRIER,
                    d.since,
                    f"{r.iface}: {d.state}",
                    incident_path=str(SYSFS_NET / r.iface),
                )
            )
    return still, out


class NicMonitor:
    name = "nic"

    def __init__(self, ifaces: Sequence[str], grace: float, sysfs: Path = SYSFS_NET) -> None:
        self.ifaces = tuple(ifaces)
        self.grace = grace
        self.sysfs = sysfs
        self._seen: set[str] = set()
        self._missing_logged: set[str] = set()
        self._down: dict[str, LinkDown] = {}

    def start(self) -> None:
        for name in self.ifaces:
            if not (self.sysfs / name).exists():
                log.error(
                    "--taint-watch-nics: no interface %s in this network namespace (%s); it "
                    "counts once it appears. A pod sees the host's NICs only with hostNetwork "
                    "or a device plugin that moves them in",
                    name,
                    self.sysfs,
                )
                self._missing_logged.add(name)

    def readings(self) -> list[LinkReading]:
        out = []
        for name in self.ifaces:
            state = link_state(name, None, self.sysfs)
            if state.error:
                if name in self._seen:
                    out.append(LinkReading(name, present=False, carrier=None))
                elif name not in self._missing_logged:
                    log.error("--taint-watch-nics: %s", state.error)
                    self._missing_logged.add(name)
                continue
            self._seen.add(name)
            out.append(LinkReading(name, True, state.carrier, state.operstate))
        return out

    def poll(self, now: float) -> tuple[Evidence, ...]:
        self._down, evidence = carrier_evidence(self.readings(), self._down, now, self.grace)
        return tuple(evidence)

    def close(self) -> None:
        pass


class PrecheckMonitor:
    """This node's part of a precheck report file, read again whenever the file changes (the
    precheck writes it whole and renames it into place)."""

    name = "precheck"
    FLAG = "--taint-precheck-report"

    def __init__(self, path: Path, node: str) -> None:
        self.path = path
        self.node = node
        self._key: tuple[int, int] | None = None
        self._evidence: tuple[Evidence, ...] = ()

    def start(self) -> None:
        if not self.path.exists():
            log.info(
                "no precheck report at %s yet: it counts once `diag precheck` writes it", self.path
            )

    def poll(self, now: float) -> tuple[Evidence, ...]:
        try:
            st = self.path.stat()
        except OSError:
            self._key, self._evidence = None, ()
            return ()
        key = (st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._key = key
            try:
                self._evidence = tuple(from_precheck_report(self.path, self.node, self.FLAG))
            except UsageError as e:
                log.error("%s", e)
                self._evidence = ()
        return self._evidence

    def close(self) -> None:
        pass


def monitors_for(settings: HealthSettings, node: str, xid_memory: float) -> list[Monitor]:
    from diag.agent.taint.gpuhealth import NvmlMonitor

    out: list[Monitor] = []
    if settings.nics:
        out.append(NicMonitor(settings.nics, settings.nic_grace))
    if settings.precheck_report is not None:
        out.append(PrecheckMonitor(settings.precheck_report, node))
    if settings.gpu:
        out.append(NvmlMonitor(settings.ecc_interval, xid_memory))
    return out
