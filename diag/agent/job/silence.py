"""A node that goes silent during an incident is the suspect, pure: which of the peers this node
knows stopped answering (and for how long), whether the job verdict waits for them, and the
culprit it then names.

Why: when a whole node is lost (power, kernel, its pod evicted with everything in it), its
agent files nothing and its ranks vanish. The ranks of the other nodes fail a moment later,
because their peer vanished: their agents see a death and blame their own rank first-hand, and
the job verdict used to name a survivor. (With NCCL, or when the sockets did not close, the
survivors' ranks wait instead, for ranks no node's view holds.) So, before a job verdict is
concluded, its claimant asks the peers it knows (those it exchanges replicas with,
`--replica-nodes`) whether their agents answer. A peer whose agent answers is there: the
incident stands as the reports say. A peer silent for `lost_after` seconds is lost: it is the
culprit; the ranks that died on the other nodes are its victims, and those that waited waited
for it. The wait is bounded: `lost_after` after the first probe that found the peer silent, and
`lost_after` + `slack` from the claimant's first look in all.

A node can also be lost and back before anyone asks: a preempted pod replaced, a node that
rebooted, its agent started afresh. Its agent answers, but says it started while the
claimant's ranks ran (more than `RUN_GAP` after they started: every node's agent starts with
its launcher, before the rendezvous the ranks wait for) and at most `CAME_BACK_S` before their
first sign: that node was lost too, its ranks with it.

Times are one clock's (the caller's), passed in.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from diag.agent.job.decisions import RUN_GAP, ReportName, Where

# A peer's agent that started this long before the claimant's first sign, or less, while the
# claimant's ranks ran, came back from a loss that may explain it: the survivors of a lost node
# fail within their collective timeout, or at their launcher's next rendezvous.
CAME_BACK_S = 300.0


@dataclass(frozen=True)
class PeerLook:
    """What this node knows of one peer at a look."""

    node: str
    ranks: tuple[int, ...]  # its ranks (from the replica this node holds of it); () unknown
    answers: bool | None  # its agent answered the last probe; None: not probed yet
    since: float  # since when it has been so (the first probe that found it so)
    agent_started: float | None = None  # when its agent started, as it said; None: unsaid


@dataclass(frozen=True)
class LostNode:
    node: str
    ranks: tuple[int, ...]
    silent_for: float  # seconds its agent had been silent at the judgement
    came_back_at: float | None = None  # its agent started afresh then (silent_for is 0)


@dataclass(frozen=True)
class Silence:
    lost: tuple[LostNode, ...]  # peers silent for `lost_after` seconds
    wait_until: float | None  # a peer silent, or not probed, for less: look again until then


def judge(
    peers: Sequence[PeerLook],
    *,
    now: float,
    lost_after: float,
    started: float,
    slack: float,
    ranks_since: float | None = None,
    first_sign: float | None = None,
) -> Silence:
    """The peers lost by `now`, and whether to look again. `started`: the claimant's first
    look; it waits at most `lost_after` + `slack` from then (a peer that takes longer to probe
    than that counts as answering: the death stands as its node saw it). `ranks_since` and
    `first_sign`: when the claimant's ranks started and first failed, to tell a peer that came
    back (see the module's text)."""
    lost = []
    pending = []
    for p in peers:
        if p.answers and came_back(p, ranks_since, first_sign):
            assert p.agent_started is not None
            lost.append(LostNode(p.node, tuple(sorted(p.ranks)), 0.0, p.agent_started))
            continue
        if p.answers:
            continue
        if p.answers is False and now - p.since >= lost_after:
            lost.append(LostNode(p.node, tuple(sorted(p.ranks)), now - p.since))
            continue
        pending.append(p.since + lost_after if p.answers is False else now)
    give_up = started + lost_after + slack
    wait = min(max(pending), give_up) if pending and now < give_up else None
    return Silence(tuple(sorted(lost, key=lambda n: (-n.silent_for, n.node))), wait)


def came_back(p: PeerLook, ranks_since: float | None, first_sign: float | None) -> bool:
    if p.agent_started is None or ranks_since is None or first_sign is None:
        return False
    return ranks_since + RUN_GAP < p.agent_started and first_sign - CAME_BACK_S <= p.agent_started


def victims(names: Sequence[ReportName], lost: Sequence[LostNode]) -> list[ReportName]:
    """The first-hand reports of ranks that died on nodes still there: their peer vanished."""
    gone = {n.node for n in lost}
    return [
        n for n in names if n.where == Where.LOCAL and n.culprit is not None and n.node not in gone
    ]


def blame_lost(
    names: Sequence[ReportName], lost: Sequence[LostNode]
) -> tuple[int | None, str, str]:
    """(rank, node, basis) naming the node silent longest (its lowest rank, when its ranks are
    known); the deaths its nodes reported first-hand are its victims, and the basis says so."""
    first = lost[0]
    rank = first.ranks[0] if first.ranks else None
    hurt = victims(names, lost)
    gone = {n.node for n in lost}
    waited = sorted({n.node for n in names if n.where == Where.REMOTE and n.node not in gone})
    others = [n.node for n in lost[1:]]
    ranks = f"ranks {_span(first.ranks)}" if first.ranks else "its ranks"
    if first.came_back_at is not None:
        at = dt.datetime.fromtimestamp(first.came_back_at, dt.UTC).strftime("%H:%M:%S")
        basis = (
            f"node {first.node} was lost and came back: its agent started afresh at {at} UTC, "
            f"while the job ran, and {ranks} vanished from the job"
        )
    else:
        basis = (
            f"node {first.node} went silent: its agent has not answered for "
            f"{first.silent_for:.1f} s and {ranks} vanished from the job"
        )
    if hurt:
        died = ", ".join(f"rank {n.culprit} on {n.node}" for n in hurt)
        basis += f"; {died} died after it (victims: their peer vanished)"
    if waited:
        basis += f"; the ranks of {', '.join(waited)} waited for it"
    if others:
        basis += f"; also silent: {', '.join(others)}"
    return rank, first.node, basis


def _span(ranks: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)
