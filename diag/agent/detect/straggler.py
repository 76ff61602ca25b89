"""Stragglers: ranks that are slow but progress. Not a hang, but worth naming.

On one node all ranks share a clock, so for every collective seen on several ranks we know when
each rank arrived. The last to arrive makes the others wait; a rank that is last again and again
and costs the others a large share of the wall time is a straggler. Scores are plain data for the
metrics and the demo's report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import median

from diag.agent.detect.observation import OpView

STRAGGLER_SCORE = 0.1  # the others lose at least 10% of the wall time waiting for this rank
STRAGGLER_WAIT_SHARE = 0.5  # ... and it causes most of all the waiting there is


@dataclass(frozen=True)
class StragglerScore:
    rank: int
    ops: int  # collectives compared
    late_share: float  # share of them where this rank arrived last
    wait_caused: float  # mean seconds the others waited for this rank per collective
    score: float  # waiting this rank caused, as a share of the window's wall time
    wait_share: float = 0.0  # its share of all the waiting the compared ranks caused

    @property
    def is_straggler(self) -> bool:
        # Not "last most often": a rank that sleeps before each step is last only in the step's
        # first collective, and arrival order in the others is noise. What singles it out is
        # that the others' waiting is mostly for it.
        return self.score >= STRAGGLER_SCORE and self.wait_share >= STRAGGLER_WAIT_SHARE


def straggler_scores(
    recent_ops: Mapping[int, Sequence[OpView]], min_ops: int = 20
) -> list[StragglerScore]:
    """Scores per rank from recently completed collectives, worst first."""
    arrivals: dict[tuple[str, int], dict[int, float]] = {}
    for rank, ops in recent_ops.items():
        for op in ops:
            if op.peer >= 0:
                continue  # p2p ops have two parties; arrival order says little
            arrivals.setdefault((op.group, op.group_seq), {})[rank] = op.t_enqueue
    late: dict[int, int] = {}
    caused: dict[int, float] = {}
    seen: dict[int, int] = {}
    t_min, t_max = float("inf"), float("-inf")
    for ranks in arrivals.values():
        if len(ranks) < 2:
            continue
        last_rank, last_t = max(ranks.items(), key=lambda kv: kv[1])
        others = [t for r, t in ranks.items() if r != last_rank]
        for r in ranks:
            seen[r] = seen.get(r, 0) + 1
        late[last_rank] = late.get(last_rank, 0) + 1
        caused[last_rank] = caused.get(last_rank, 0.0) + (last_t - median(others))
        t_min, t_max = min(t_min, *ranks.values()), max(t_max, *ranks.values())
    window = t_max - t_min
    all_caused = sum(caused.values())
    out = []
    for r, n in seen.items():
        if n < min_ops or window <= 0:
            continue
        total = caused.get(r, 0.0)
        out.append(
            StragglerScore(
                rank=r,
                ops=n,
                late_share=late.get(r, 0) / n,
                wait_caused=total / n,
                score=min(total / window, 1.0),
                wait_share=total / all_caused if all_caused > 0 else 0.0,
            )
        )
    out.sort(key=lambda s: (-s.score, s.rank))
    return out
