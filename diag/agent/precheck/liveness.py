"""Which nodes are still there: heartbeat counters read by the coordinator, judged on its clock.

Each node bumps a counter in the store every heartbeat interval. The coordinator remembers when
it last saw each counter change, on its own monotonic clock, so clocks of different nodes never
have to agree. A node whose counter has not moved for `lost_after` seconds is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeatTracker:
    lost_after_s: float
    _last: dict[int, tuple[int, float]] = field(default_factory=dict)  # node -> (count, seen at)

    def observe(self, node: int, count: int, now: float) -> None:
        prev = self._last.get(node)
        if prev is None or prev[0] != count:
            self._last[node] = (count, now)

    def silent_for(self, node: int, now: float) -> float | None:
        prev = self._last.get(node)
        return None if prev is None else now - prev[1]

    def stale(self, now: float) -> list[int]:
        return sorted(n for n, (_, t) in self._last.items() if now - t > self.lost_after_s)


@dataclass(frozen=True)
class PhaseDeadline:
    """How long the coordinator waits for a phase's results, and why it stopped waiting."""

    phase: str
    limit_s: float

    def missing_reason(self) -> str:
        return f"no result for {self.phase} within {self.limit_s:g} s (stuck or lost)"

    def lost_reason(self, lost_after_s: float) -> str:
        return (
            f"no heartbeat for {lost_after_s:g} s during {self.phase} "
            "(process died or network lost)"
        )


def pair_limit_s(
    connect_s: float, collective_s: float, pair_seconds: float, warmup_iters: int
) -> float:
    """The longest a node lets one pair test take: every step at its own timeout, plus slack.
    Past it the node gives the test up as failed (see `measure.bounded_pair_allreduce`)."""
    return connect_s + pair_seconds + (warmup_iters + 1) * collective_s + 2.0


def round_limit_s(
    connect_s: float,
    collective_s: float,
    pair_seconds: float,
    warmup_iters: int,
    lost_after_s: float,
) -> float:
    """How long the coordinator waits for a round's results: the nodes' own limit plus time to
    post the result to a slow store."""
    return pair_limit_s(connect_s, collective_s, pair_seconds, warmup_iters) + lost_after_s + 5.0
