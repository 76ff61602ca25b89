"""Stopping this node's ranks for an incident another node of the job reported, pure.

With `--on-hang stop` a node's agent stops its ranks at its own verdict. A node whose ranks only
wait for a rank elsewhere may reach no verdict of its own in time: the culprit's node stops its
ranks first, and this node's ranks fail on their own a moment later, after their launcher has
missed the restart round the others began. So a node with live ranks and no incident open
looks at the job's incidents (one listing every `LOOK_EVERY` seconds; nothing is written) and
stops its ranks, through the same actions as its own verdict (evidence, checkpoints, then the
stop), once an incident of its ranks' attempt is known to break the job:

- a first-hand claim (a node blamed one of its own ranks: a hang, a rank outside the
  collective, or a death) or a first-hand report under another node's claim: the job verdict
  will name that rank, so there is nothing to wait for;
- a death (a rank of that attempt died: the job cannot go on);
- otherwise (views only, a fallback) the job verdict once it is in place.

Never twice in one era of the ranks (an attempt, or a world formed again in place within it): an
incident this node opened itself (its own verdict stopped its ranks) or one it followed closes
the era; the ranks' restart, or their next world, opens the next. Never for an incident of
another job (the job's own directory is the only one looked at), of another era, claimed before this node's ranks started (an earlier run's), or claimed by this
node itself.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from diag.agent.detect.hang import Verdict, VerdictKind
from diag.agent.detect.observation import Observation
from diag.agent.job.decisions import DEATH, Known, Where, era_of, fresh, kind_of

# Seconds between two looks at the job's incidents: the stop comes at most this long (and one
# `--interval`) after the claim, for one listing of a small directory a second in steady state.
LOOK_EVERY = 1.0


class Trigger(enum.Enum):
    FIRST_HAND = "first-hand"  # a node blamed one of its own ranks
    DEATH = "death"  # a rank of the attempt died
    JOB_VERDICT = "job-verdict"  # the job verdict of a fallback is in place


@dataclass(frozen=True)
class Local:
    """This node at one look."""

    node: str
    attempt: int
    live_ranks: int
    since_wall: float  # its ranks started then (wall clock)
    open_incident: str | None  # the incident the decision core holds open, if any
    stop: bool  # --on-hang stop
    world: int = 0  # the world's generation within the attempt (Observation.world)

    @property
    def era(self) -> tuple[int, int]:
        return (self.attempt, self.world)


@dataclass(frozen=True)
class StopState:
    looked_at: float = float("-inf")
    closed_era: tuple[int, int] | None = None  # its ranks were stopped (or an incident opened) then
    followed: str | None = None  # the job incident it stopped its ranks for


@dataclass(frozen=True)
class Follow:
    state: StopState
    incident: Known | None = None  # the job incident to stop the ranks for
    trigger: Trigger | None = None


def wants_look(state: StopState, local: Local, now: float) -> bool:
    """Whether the job's incidents are worth a listing now."""
    return (
        local.stop
        and local.live_ranks > 0
        and local.open_incident is None
        and state.closed_era != local.era
        and now - state.looked_at >= LOOK_EVERY
    )


def closed(state: StopState, local: Local) -> StopState:
    """The state once the decision core opened an incident of its own in this era."""
    if local.open_incident is not None and state.closed_era != local.era:
        return replace(state, closed_era=local.era)
    return state


def trigger_of(k: Known) -> Trigger | None:
    """What makes incident `k` break the job, as far as this node can tell at once."""
    claim = k.claim
    if kind_of(k.incident_id) == DEATH:
        return Trigger.DEATH
    if k.marked or (claim is not None and claim.where == Where.LOCAL and claim.culprit is not None):
        return Trigger.FIRST_HAND
    if k.verdict:
        return Trigger.JOB_VERDICT
    return None


def follow(state: StopState, local: Local, known: Sequence[Known], now: float) -> Follow:
    """The incident of `known` (one listing of the job's incidents, with `verdict` and `marked`
    looked at for the claims that are not first-hand) this node stops its ranks for, if any."""
    state = closed(state, local)
    if not wants_look(state, local, now):
        return Follow(state)
    state = replace(state, looked_at=now)
    ours = [
        k for k in known
        if era_of(k.incident_id) == local.era
        and fresh(k.claimed_wall, local.since_wall)
        and k.claim is not None  # a claim being written: the next look reads it
        and k.claim.node != local.node
    ]  # fmt: skip
    hits = [(k, t) for k in ours if (t := trigger_of(k)) is not None]
    if not hits:
        return Follow(state)
    k, t = min(hits, key=lambda kt: (kt[0].claimed_wall, kt[0].incident_id))
    return Follow(
        replace(state, closed_era=local.era, followed=k.incident_id), incident=k, trigger=t
    )


def needs_settled(k: Known) -> bool:
    """Whether the adapter should look for `k`'s verdict and first-hand marker (two stats):
    only for a claim of the attempt that does not say enough by itself."""
    return trigger_of(k) is None


def verdict_for(f: Follow, obs: Observation) -> Verdict | None:
    """This node's verdict under the job incident it follows: no culprit of its own (the job
    verdict names it), its id the job incident's, so its evidence lands with the others'."""
    k = f.incident
    if k is None or f.trigger is None:
        return None
    try:
        kind = VerdictKind(kind_of(k.incident_id))
    except ValueError:
        kind = VerdictKind.HANG
    claim = k.claim
    who = ""
    if claim is not None:
        rank = "" if claim.culprit is None else f"rank {claim.culprit} on "
        who = f"{rank}node {claim.node}"
    because = {
        Trigger.FIRST_HAND: f"{who} reported it first-hand",
        Trigger.DEATH: f"a rank died ({who} reported it)",
        Trigger.JOB_VERDICT: "its job verdict is in place",
    }[f.trigger]
    return Verdict(
        kind=kind,
        incident_id=k.incident_id,
        at=obs.now,
        culprit=None,
        suspects=(),
        overdue=(),
        waits=(),
        summary=(
            f"{kind.value}: job incident {k.incident_id} on another node ({because}): stopping "
            f"the local ranks with the rest of the job (trigger: {f.trigger.value})"
        ),
    )
