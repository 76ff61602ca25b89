"""What the checks measured: plain frozen dataclasses, shipped between nodes as JSON.

A node measures its own devices, compute, intra-node copies and NIC state (`LocalEvidence`) and
its side of each inter-node pair it joins (`PairSide`); the coordinator merges the two sides of
a pair into a `PairResult`. Nothing here judges: `classify` does that.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class Check(enum.StrEnum):
    """Which check a finding comes from (kept in the report so that tainting can tell them apart)."""

    RENDEZVOUS = "rendezvous"  # the node never joined
    LIVENESS = "liveness"  # the node's process died or it lost contact mid-run
    NIC = "nic"  # the node's own network interface (carrier, state)
    DEVICE = "device"  # GPU health from NVML
    COMPUTE = "compute"  # matmul throughput
    INTRA = "intra"  # copy bandwidth between device pairs of the node
    INTER = "inter"  # collective bus bandwidth between nodes


@dataclass(frozen=True)
class DeviceHealth:
    """One GPU as NVML saw it. `None` means NVML could not tell (not supported on that part)."""

    index: int
    name: str = ""
    memory_used_fraction: float | None = None
    ecc_uncorrected: int | None = None  # volatile (since driver load) uncorrected ECC errors
    xid_errors: tuple[int, ...] = ()  # critical XID events seen while the check ran
    remap_failed: bool | None = None  # row remapping failed: the part needs service
    temperature_c: float | None = None
    error: str | None = None  # NVML failed to query this device


@dataclass(frozen=True)
class ComputeResult:
    device: str  # "cpu", "cuda:0", ...
    flops: float | None = None  # best sustained FLOP/s
    matmul_size: int = 0
    dtype: str = ""
    threads: int = 0  # CPU threads the matmul ran on (0 on GPU)
    error: str | None = None


@dataclass(frozen=True)
class CopyResult:
    """Copy bandwidth from device `src` to device `dst` on one node."""

    src: int
    dst: int
    bytes_per_s: float | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.src}-{self.dst}"


@dataclass(frozen=True)
class NicState:
    """The interface that carries this node's traffic to the rendezvous host."""

    iface: str | None = None
    addr: str | None = None
    operstate: str | None = None  # /sys/class/net/IFACE/operstate
    carrier: bool | None = None
    speed_mbps: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class LocalEvidence:
    node: int
    host: str = ""
    accelerator: str = "cpu"  # "cpu" or "cuda"
    devices: tuple[DeviceHealth, ...] = ()
    compute: tuple[ComputeResult, ...] = ()
    copies: tuple[CopyResult, ...] = ()
    nic: NicState | None = None
    notes: tuple[str, ...] = ()  # checks skipped and why
    error: str | None = None  # the local checks as a whole failed (timed out, crashed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LocalEvidence:
        nic = d.get("nic")
        return cls(
            node=int(d["node"]),
            host=str(d.get("host", "")),
            accelerator=str(d.get("accelerator", "cpu")),
            devices=tuple(
                DeviceHealth(**{**x, "xid_errors": tuple(x.get("xid_errors", ()))})
                for x in d.get("devices", ())
            ),
            compute=tuple(ComputeResult(**x) for x in d.get("compute", ())),
            copies=tuple(CopyResult(**x) for x in d.get("copies", ())),
            nic=NicState(**nic) if nic else None,
            notes=tuple(d.get("notes", ())),
            error=d.get("error"),
        )


@dataclass(frozen=True)
class PairSide:
    """One node's view of one inter-node pair test."""

    round: int
    node: int
    peer: int
    busbw: float | None = None  # bytes/s, nccl-tests convention
    iters: int = 0
    seconds: float = 0.0
    msg_bytes: int = 0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PairSide:
        return cls(**d)


@dataclass(frozen=True)
class PairResult:
    """Both sides of a pair merged: measured when both sides measured, failed otherwise."""

    round: int
    a: int
    b: int
    busbw: float | None = None  # the lower of the two sides' numbers
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.busbw is not None

    def other(self, node: int) -> int:
        return self.b if node == self.a else self.a

    def has(self, node: int) -> bool:
        return node in (self.a, self.b)


def merge_sides(round_: int, a: int, b: int, sides: list[PairSide]) -> PairResult:
    """Merge the sides that arrived; a missing side means that node never reported the pair."""
    by_node = {s.node: s for s in sides}
    errors = []
    for n in (a, b):
        s = by_node.get(n)
        if s is None:
            errors.append(f"node {n} reported no result")
        elif s.error is not None:
            errors.append(f"node {n}: {s.error}")
    if errors:
        return PairResult(round_, a, b, None, "; ".join(errors))
    rates = [by_node[n].busbw for n in (a, b)]
    if any(r is None for r in rates):
        return PairResult(round_, a, b, None, "no bandwidth measured")
    return PairResult(round_, a, b, min(r for r in rates if r is not None), None)


@dataclass(frozen=True)
class Finding:
    """One thing found about one node: which check, how bad, and why (with the numbers)."""

    check: Check
    severity: Severity
    message: str


class Severity(enum.StrEnum):
    """A node's status is the worst severity among its findings (HEALTHY when none)."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"  # involved in a problem that could not be pinned on one node
    STRAGGLER = "straggler"
    FAULTY = "faulty"

    @property
    def rank(self) -> int:
        return _SEVERITY_ORDER[self]


_SEVERITY_ORDER = {
    Severity.HEALTHY: 0,
    Severity.SUSPECT: 1,
    Severity.STRAGGLER: 2,
    Severity.FAULTY: 3,
}


def worst(findings: list[Finding] | tuple[Finding, ...]) -> Severity:
    return max((f.severity for f in findings), key=lambda s: s.rank, default=Severity.HEALTHY)
