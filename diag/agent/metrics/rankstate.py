"""Per-rank state as numbers: what the rank gauges show at one instant. Pure.

Computed from the agent's latest observation at scrape time, so a rank that restarted or went
away never leaves a stale series behind, and the agent's loop pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from diag.agent.detect.hang import Verdict, VerdictKind
from diag.agent.detect.observation import Observation
from diag.agent.detect.overdue import overdue_ranks
from diag.agent.detect.straggler import StragglerScore
from diag.agent.detect.timeouts import TimeoutPolicy


@dataclass(frozen=True)
class RankMetrics:
    rank: int
    local_rank: int
    alive: bool
    step: int
    step_seconds: float | None  # None before the second step ends
    since_progress: float
    hang_limit: float | None  # None once the rank ended
    hung: bool
    culprit: bool
    pending_ops: int
    cpu_ratio: float
    straggler_score: float | None = None  # None until enough collectives were compared
    straggler_late: float | None = None
    straggler_wait_share: float | None = None


def rank_metrics(
    obs: Observation,
    timeouts: TimeoutPolicy,
    incident: Verdict | None = None,
    stragglers: tuple[StragglerScore, ...] | list[StragglerScore] = (),
) -> tuple[RankMetrics, ...]:
    """`incident` is the open one, if any. A rank is hung while it is over its limit, which is
    exactly what the hang rule tests, and so is the culprit of an open hang: a rank idle outside
    any collective is held to the longer ceiling, but when others wait for it, it is stuck too."""
    limits, overdue = overdue_ranks(obs, timeouts)
    hung = {o.rank for o in overdue}
    culprit = incident.culprit if incident is not None else None
    if culprit is not None and incident is not None and incident.kind != VerdictKind.RANK_EXITED:
        hung.add(culprit)
    scores = {s.rank: s for s in stragglers}
    out = []
    for r in obs.ranks:
        limit = limits.get(r.rank)
        s = scores.get(r.rank)
        out.append(
            RankMetrics(
                rank=r.rank,
                local_rank=r.local_rank,
                alive=r.alive,
                step=r.step,
                step_seconds=r.step_durations[-1] if r.step_durations else None,
                since_progress=max(0.0, obs.now - r.last_activity),
                hang_limit=limit.seconds if limit is not None else None,
                hung=r.rank in hung,
                culprit=r.rank == culprit,
                pending_ops=len(r.pending),
                cpu_ratio=r.cpu_busy,
                straggler_score=s.score if s is not None else None,
                straggler_late=s.late_share if s is not None else None,
                straggler_wait_share=s.wait_share if s is not None else None,
            )
        )
    return tuple(out)
