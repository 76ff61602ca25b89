"""Everything `diag precheck` is told, read once at the entry point and passed down."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from diag.agent.precheck.grading import Thresholds

CPU_MSG_BYTES = 8 << 20
GPU_MSG_BYTES = 64 << 20
CPU_MATMUL = 512
GPU_MATMUL = 8192


class LocalCheck(enum.StrEnum):
    DEVICE = "device"
    COMPUTE = "compute"
    INTRA = "intra"
    INTER = "inter"


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    iface: str | None = None  # interface for inter-node traffic; default: the one to master


@dataclass(frozen=True)
class Timeouts:
    rdzv_s: float = 300.0  # for all nodes to join
    connect_s: float = 30.0  # for the two nodes of a pair to connect
    collective_s: float = 30.0  # for each allreduce
    local_s: float = 300.0  # for the device, compute and intra-node checks of a node
    lost_after_s: float = 10.0  # no heartbeat for this long: the node is gone
    heartbeat_s: float = 1.0


@dataclass(frozen=True)
class DevicePairs:
    """Which device pairs of a node to copy between: a ring, all pairs, or an explicit list."""

    mode: str = "ring"  # "ring", "all" or "list"
    pairs: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> DevicePairs:
        text = text.strip()
        if text in ("ring", "all"):
            return cls(text)
        pairs = []
        for item in text.split(","):
            a, sep, b = item.strip().partition("-")
            if not sep or not a.isdigit() or not b.isdigit() or a == b:
                raise ValueError(f"bad device pair {item!r}: use ring, all, or a list like 0-1,2-3")
            pairs.append((int(a), int(b)))
        return cls("list", tuple(pairs))

    def text(self) -> str:
        """As `parse` reads it."""
        if self.mode != "list":
            return self.mode
        return ",".join(f"{a}-{b}" for a, b in self.pairs)

    def resolve(self, count: int) -> list[tuple[int, int]]:
        if count < 2:
            return []
        if self.mode == "ring":
            return [(i, (i + 1) % count) for i in range(count)]
        if self.mode == "all":
            return [(i, j) for i in range(count) for j in range(count) if i != j]
        return [(a, b) for a, b in self.pairs if a < count and b < count]


@dataclass(frozen=True)
class Measure:
    device: str = "auto"  # auto, cpu, cuda
    msg_bytes: int | None = None  # allreduce size; default by device
    pair_seconds: float = 1.0  # time budget of each pair's timed iterations
    warmup_iters: int = 1
    max_iters: int = 50
    matmul_size: int | None = None  # default by device
    compute_seconds: float = 1.0
    compute_threads: int = 1  # CPU only: a per-core number stays comparable on shared hosts
    copy_bytes: int = 256 << 20
    device_pairs: DevicePairs = field(default_factory=DevicePairs)
    net_device: int = 0  # local GPU that runs the inter-node collectives
    checks: frozenset[LocalCheck] = frozenset(LocalCheck)

    def msg_bytes_for(self, accelerator: str) -> int:
        if self.msg_bytes is not None:
            return self.msg_bytes
        return GPU_MSG_BYTES if accelerator == "cuda" else CPU_MSG_BYTES

    def matmul_for(self, accelerator: str) -> int:
        if self.matmul_size is not None:
            return self.matmul_size
        return GPU_MATMUL if accelerator == "cuda" else CPU_MATMUL


@dataclass(frozen=True)
class PrecheckSettings:
    rdzv: Rendezvous
    job: str = "default"
    timeouts: Timeouts = field(default_factory=Timeouts)
    measure: Measure = field(default_factory=Measure)
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_rounds: int = 5

    def settings(self) -> dict[str, str | float | int | None]:
        """The knobs that shaped the verdict, flat, for the report."""
        t, m, th = self.timeouts, self.measure, self.thresholds
        return {
            "nnodes": self.rdzv.nnodes,
            "master": f"{self.rdzv.master_addr}:{self.rdzv.master_port}",
            "rdzv_timeout_s": t.rdzv_s,
            "connect_timeout_s": t.connect_s,
            "collective_timeout_s": t.collective_s,
            "local_timeout_s": t.local_s,
            "lost_after_s": t.lost_after_s,
            "device": m.device,
            "msg_bytes": m.msg_bytes,
            "pair_seconds": m.pair_seconds,
            "matmul_size": m.matmul_size,
            "compute_threads": m.compute_threads,
            "checks": ",".join(sorted(c.value for c in m.checks)),
            "max_rounds": self.max_rounds,
            "straggler_ratio": th.straggler_ratio,
            "min_busbw_bytes_per_s": th.min_busbw,
            "compute_ratio": th.compute_ratio,
            "copy_ratio": th.copy_ratio,
            "min_copy_bytes_per_s": th.min_copy_bw,
            "max_gpu_memory_used": th.max_gpu_memory_used,
            "max_gpu_temp_c": th.max_gpu_temp_c,
        }
