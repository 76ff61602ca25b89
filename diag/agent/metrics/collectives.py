"""Collective ops as metrics: op kinds, bus bandwidth, and which completions are new. Pure.

Bus bandwidth follows nccl-tests: the algorithm bandwidth (message bytes / time) times a factor
that makes the number comparable with the link speed whatever the op and the group size n:
allreduce 2(n-1)/n; allgather, reduce-scatter, alltoall, gather, scatter (n-1)/n; broadcast,
reduce and point-to-point 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diag.agent.detect.observation import OpView
from diag.formats.records import OpCode

# Variants of one collective (coalesced, _base, single) share a kind: fewer series, same meaning.
_KINDS: dict[OpCode, str] = {
    OpCode.ALL_REDUCE: "all_reduce",
    OpCode.ALL_REDUCE_COALESCED: "all_reduce",
    OpCode.BROADCAST: "broadcast",
    OpCode.REDUCE: "reduce",
    OpCode.ALL_GATHER: "all_gather",
    OpCode.ALL_GATHER_BASE: "all_gather",
    OpCode.ALL_GATHER_COALESCED: "all_gather",
    OpCode.REDUCE_SCATTER: "reduce_scatter",
    OpCode.REDUCE_SCATTER_BASE: "reduce_scatter",
    OpCode.REDUCE_SCATTER_COALESCED: "reduce_scatter",
    OpCode.ALL_TO_ALL: "all_to_all",
    OpCode.ALL_TO_ALL_BASE: "all_to_all",
    OpCode.GATHER: "gather",
    OpCode.SCATTER: "scatter",
    OpCode.BARRIER: "barrier",
    OpCode.MONITORED_BARRIER: "barrier",
    OpCode.SEND: "send",
    OpCode.RECV: "recv",
    OpCode.RECV_ANYSOURCE: "recv",
}
OP_KINDS: tuple[str, ...] = (*dict.fromkeys(_KINDS.values()), "other")

_RING = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


def op_kind(op: OpCode) -> str:
    return _KINDS.get(op, "other")


def bus_factor(op: OpCode, group_size: int) -> float:
    kind = op_kind(op)
    n = max(group_size, 1)
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in _RING:
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class Bandwidth:
    rank: int
    kind: str
    ops: int
    bus_bytes: float
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.bus_bytes / self.seconds if self.seconds > 0 else 0.0


def bus_bandwidth(
    recent_ops: Mapping[int, Sequence[OpView]], groups: Mapping[str, tuple[int, ...]]
) -> list[Bandwidth]:
    """Per rank and op kind: bus bytes of the recent completed ops over the time they took.

    A sum over a sum, not a mean of ratios, so one tiny op does not outweigh many big ones. Ops
    without bytes (barriers) or without a measurable duration do not count.
    """
    acc: dict[tuple[int, str], list[float]] = {}
    for rank, ops in recent_ops.items():
        for op in ops:
            if op.t_end is None or op.nbytes <= 0:
                continue
            seconds = op.t_end - op.t_enqueue
            if seconds <= 0:
                continue
            n = len(groups.get(op.group, ())) or 2
            slot = acc.setdefault((rank, op_kind(op.op)), [0, 0.0, 0.0])
            slot[0] += 1
            slot[1] += op.nbytes * bus_factor(op.op, n)
            slot[2] += seconds
    return [
        Bandwidth(rank, kind, int(n), bus_bytes, seconds)
        for (rank, kind), (n, bus_bytes, seconds) in sorted(acc.items())
    ]


def new_completions(last_seen: OpView | None, ops: Sequence[OpView]) -> Sequence[OpView]:
    """The ops after `last_seen` in a rank's window of recent completions (oldest first).

    The window is a bounded deque the observer appends to, so the op we saw last is found by
    identity near its end; when it is gone (the window moved past it, or the rank restarted with
    a new journal) the whole window is new.
    """
    if last_seen is None:
        return ops
    for i in range(len(ops) - 1, -1, -1):
        if ops[i] is last_seen:
            return ops[i + 1 :]
    return ops
