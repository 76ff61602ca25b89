"""The claimant of a fallback (no node blamed its own rank, so every node files its view of its
ranks): what it has gathered, and when it may conclude. Pure: times come in as arguments; the
file adapter (`verdict.py`) lists, reads and sleeps.

The rule. A first-hand report (a node blaming one of its own ranks) wins whenever one exists,
so the claimant concludes from the views only when none can still come:

- once the views hold every rank of the job, every node that runs one of its ranks has filed a
  view that blames none of its own: no first-hand report is on its way. Only a node that
  changes its mind afterwards could file one, and the claimant still looks for one (the
  first-hand marker, one check) for `quiet` seconds after it saw the views complete and once
  more just before it puts the verdict in place; the analysis of the views runs meanwhile;
- while a view is missing (a node's agent is gone, or it has not filed yet) the culprit's node
  may still report first-hand: the claimant waits until its settle time has run out (the
  settle time since it filed its own view), then concludes on the views it has.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from diag.agent.job.assembly import pick_culprit
from diag.agent.job.decisions import NodeReport, ReportName, Where
from diag.agent.job.nodeview import Gathered, analyse, expand, fold_rank_lists

# How long the claimant keeps looking for a first-hand report after the views came to hold
# every rank: a margin for a node that changes its mind just after filing its view, and for a
# file written a moment before to show in a listing of the shared volume. The analysis of the
# views (seconds at 16,000 nodes) runs within it.
QUIET = 0.5


class Step(enum.Enum):
    WAIT = "wait"  # look again later
    FIRST_HAND = "first-hand"  # a node blamed its own rank: conclude on that
    VIEWS = "views"  # the views hold every rank and stayed so `quiet` seconds: the analysis
    SETTLED = "settled"  # the settle time ran out with a view missing: conclude on what came


@dataclass(frozen=True)
class Progress:
    """What the claimant knows at one look."""

    first_hand: bool  # a first-hand report was filed (its name, or the marker)
    covered_at: float | None  # when it first saw the views hold every rank; None: one missing


def step(p: Progress, now: float, *, deadline: float, quiet: float = QUIET) -> Step:
    """What the claimant does at `now`. `deadline`: the end of its settle time."""
    if p.first_hand:
        return Step.FIRST_HAND
    if p.covered_at is not None and now >= p.covered_at + quiet:
        return Step.VIEWS
    if now >= deadline:
        return Step.SETTLED
    return Step.WAIT


def wake_in(
    p: Progress, now: float, *, deadline: float, poll: float, quiet: float = QUIET
) -> float:
    """Seconds until the claimant's next look: its poll, or sooner when a time of `step` comes."""
    due = deadline if p.covered_at is None else min(deadline, p.covered_at + quiet)
    return max(0.0, min(poll, due - now))


def first_hand_in(names: list[ReportName]) -> bool:
    return any(n.where == Where.LOCAL and n.culprit is not None for n in names)


@dataclass
class Views:
    """What a claimant of a fallback has read so far: each report once, its view expanded once
    (the analysis's share of it, done while the claimant waits), and the ranks they hold."""

    reports: dict[str, NodeReport] = field(default_factory=dict)
    gathered: Gathered = field(default_factory=Gathered)  # their ranks, for the analysis
    ranks: set[int] = field(default_factory=set)
    world: int = 0
    viewless: bool = False  # a report without a view: the settle time decides

    def add(self, new: dict[str, NodeReport]) -> None:
        self.reports.update(new)
        for r in new.values():
            if r.view is None:
                self.viewless = True
                continue
            snaps = expand(r.view)
            self.gathered.add(r.view, snaps)
            self.world = max(self.world, int(r.view.get("world_size", 0)))
            self.ranks.update(s.rank for s in snaps or ())

    @property
    def cover(self) -> bool:
        """The views hold every rank of the job."""
        return not self.viewless and self.world > 0 and len(self.ranks) >= self.world

    def pick(self, names: list[ReportName], now_wall: float) -> tuple[int | None, str, str]:
        """(rank, node, basis) from the analysis of every view read (those of `names`: the
        claimant reads what it lists)."""
        a = self.gathered.attribution(now_wall)
        if a.culprit is None:
            read = {n.file: self.reports[n.file] for n in names if n.file in self.reports}
            return pick_culprit(names, read)
        views = sum(r.view is not None for r in self.reports.values())
        return a.culprit, a.node, _basis(views, a.reason)


def from_views(reports: list[NodeReport], now_wall: float) -> tuple[int, str, str] | None:
    """(rank, node, basis) from the culprit analysis over every report's view; None when the
    views name no single rank."""
    views: list[dict[str, Any]] = [r.view for r in reports if r.view is not None]
    a = analyse(views, now_wall)
    if a.culprit is None:
        return None
    return a.culprit, a.node, _basis(len(views), a.reason)


def _basis(views: int, reason: str) -> str:
    return f"from the views of {views} nodes: {fold_rank_lists(reason)}"
