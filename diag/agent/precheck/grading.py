"""Grading inter-node pair results against the job's median bus bandwidth.

A node's bandwidth is the best it reached with any partner: a slow partner drags a pair down,
so only a node that is slow with every partner is slow itself. A pair is slow when its busbw is
below `straggler_ratio` x the median of those per-node numbers (or below an absolute floor).
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from diag.agent.precheck.measurements import PairResult


class Grade(enum.StrEnum):
    GOOD = "good"
    SLOW = "slow"
    FAILED = "failed"


@dataclass(frozen=True)
class Thresholds:
    straggler_ratio: float = 0.5  # node busbw below ratio x median busbw: straggler
    min_busbw: float | None = None  # bytes/s; a pair below it is slow whatever the median
    compute_ratio: float = 0.5  # device FLOP/s below ratio x median: straggler
    copy_ratio: float = 0.5  # intra-node copy below ratio x median of all pairs: straggler
    min_copy_bw: float | None = None  # bytes/s
    max_gpu_memory_used: float = 0.3  # fraction of GPU memory in use before training
    max_gpu_temp_c: float = 85.0


def median(values: Iterable[float]) -> float | None:
    vals = list(values)
    return statistics.median(vals) if vals else None


@dataclass(frozen=True)
class Grading:
    median_busbw: float | None
    best: dict[int, float]  # node -> best busbw with any partner
    grades: dict[PairResult, Grade]

    def pairs_of(self, node: int) -> list[PairResult]:
        return [p for p in self.grades if p.has(node)]

    def good(self, node: int) -> bool:
        return any(self.grades[p] is Grade.GOOD for p in self.pairs_of(node))


def grade_pairs(pairs: Sequence[PairResult], eligible: Iterable[int], th: Thresholds) -> Grading:
    """Grade the pairs whose two nodes are both eligible (pairs with a dead node say nothing)."""
    members = set(eligible)
    kept = [p for p in pairs if p.a in members and p.b in members]
    best: dict[int, float] = {}
    for p in kept:
        if p.ok and p.busbw is not None:
            for n in (p.a, p.b):
                best[n] = max(best.get(n, 0.0), p.busbw)
    med = median(best.values())
    grades: dict[PairResult, Grade] = {}
    for p in kept:
        if not p.ok or p.busbw is None:
            grades[p] = Grade.FAILED
        elif is_slow(p.busbw, med, th):
            grades[p] = Grade.SLOW
        else:
            grades[p] = Grade.GOOD
    return Grading(med, best, grades)


def is_slow(busbw: float, med: float | None, th: Thresholds) -> bool:
    if th.min_busbw is not None and busbw < th.min_busbw:
        return True
    return med is not None and busbw < th.straggler_ratio * med
