"""What the checks measured: plain frozen dataclasses, shipped between nodes as JSON.

A node measures its own devices, compute, intra-node copies and NIC state (`LocalEvidence`) and
its side of each inter-node pair it joins (`PairSide`); the coordinator merges the two sides of
a pair into a `PairResult`. Nothing here judges: `classify` does that.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from diag.agent.node.linkstate import NicState
from diag.formats.checkedjson import TEXT, Fields

# Bounds on what another node sends: far above a real node (8-16 GPUs, a few NICs) and a real
# job (16,000 nodes), low enough that a hostile document cannot make us build millions of items.
MAX_NODES = 1 << 17
MAX_DEVICES = 1024
MAX_ITEMS = 4096  # compute results, copies, links, findings, notes of one node


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
    def from_dict(cls, d: object, source: str = "local evidence") -> LocalEvidence:
        """Checked: raises UntrustedInput naming `source` and the field on a bad document."""
        return local_evidence(Fields(d, source))


def device_health(f: Fields) -> DeviceHealth:
    return DeviceHealth(
        index=f.int("index", 0, MAX_DEVICES),
        name=f.str("name", ""),
        memory_used_fraction=f.opt_float("memory_used_fraction", 0.0, 1e3),
        ecc_uncorrected=f.opt_int("ecc_uncorrected", 0, 2**63),
        xid_errors=f.ints("xid_errors", 0, 2**31, MAX_ITEMS),
        remap_failed=f.opt_bool("remap_failed"),
        temperature_c=f.opt_float("temperature_c", -300.0, 1e4),
        error=f.opt_str("error", TEXT),
    )


def compute_result(f: Fields) -> ComputeResult:
    return ComputeResult(
        device=f.str("device"),
        flops=f.opt_float("flops", 0.0),
        matmul_size=f.int("matmul_size", 0, 1 << 31, 0),
        dtype=f.str("dtype", ""),
        threads=f.int("threads", 0, 1 << 20, 0),
        error=f.opt_str("error", TEXT),
    )


def copy_result(f: Fields) -> CopyResult:
    return CopyResult(
        src=f.int("src", 0, MAX_DEVICES),
        dst=f.int("dst", 0, MAX_DEVICES),
        bytes_per_s=f.opt_float("bytes_per_s", 0.0),
        error=f.opt_str("error", TEXT),
    )


def nic_state(f: Fields) -> NicState:
    return NicState(
        iface=f.opt_str("iface"),
        addr=f.opt_str("addr"),
        operstate=f.opt_str("operstate"),
        carrier=f.opt_bool("carrier"),
        speed_mbps=f.opt_int("speed_mbps", -1, 1 << 40),
        error=f.opt_str("error", TEXT),
    )


def local_evidence(f: Fields) -> LocalEvidence:
    nic = f.opt_obj("nic")
    return LocalEvidence(
        node=f.int("node", 0, MAX_NODES),
        host=f.str("host", ""),
        accelerator=f.str("accelerator", "cpu"),
        devices=tuple(device_health(x) for x in f.objs("devices", MAX_DEVICES)),
        compute=tuple(compute_result(x) for x in f.objs("compute", MAX_ITEMS)),
        copies=tuple(copy_result(x) for x in f.objs("copies", MAX_ITEMS)),
        nic=nic_state(nic) if nic is not None else None,
        notes=f.strs("notes", MAX_ITEMS),
        error=f.opt_str("error", TEXT),
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
    def from_dict(cls, d: object, source: str = "pair result") -> PairSide:
        """Checked: raises UntrustedInput naming `source` and the field on a bad document."""
        f = Fields(d, source)
        return cls(
            round=f.int("round", 0, MAX_ITEMS),
            node=f.int("node", 0, MAX_NODES),
            peer=f.int("peer", 0, MAX_NODES),
            busbw=f.opt_float("busbw", 0.0),
            iters=f.int("iters", 0, 1 << 40, 0),
            seconds=f.float("seconds", 0.0, 0.0),
            msg_bytes=f.int("msg_bytes", 0, 1 << 48, 0),
            error=f.opt_str("error", TEXT),
        )


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
