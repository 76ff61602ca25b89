"""Which ranks are past their limit now: each live rank's limit (adaptive, phase, warm-up, the
collective timeout of its group) and the ranks over it, with what they wait in. Pure: the time
comes in the observation. `hang.decide` turns the overdue ranks into a verdict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from diag.agent.detect.observation import Observation, OpView, RankSnapshot
from diag.agent.detect.timeouts import (
    PG_TIMEOUT_MARGIN,
    Limit,
    TimeoutPolicy,
    effective_ceiling,
    rank_limit,
    settled_at,
    waits_outside_phases,
)

# Each verdict of the idle rule in this window doubles its factor: a rank idle for a reason
# outside any collective on every step (a remote data service, a store barrier) would otherwise
# be called hung, and recover, again and again. Past the usual limit the rule gives way.
IDLE_BACKOFF_S = 1800.0


def backed_off(policy: TimeoutPolicy, idle_verdicts: int) -> TimeoutPolicy:
    """`policy` after `idle_verdicts` verdicts of the idle rule within IDLE_BACKOFF_S."""
    if not idle_verdicts or policy.idle_factor <= 0:
        return policy
    return replace(policy, idle_factor=policy.idle_factor * 2.0**idle_verdicts)


class OverdueKind(enum.Enum):
    PENDING_OP = "pending-op"
    NO_PROGRESS = "no-progress"


@dataclass(frozen=True)
class Overdue:
    rank: int
    kind: OverdueKind
    age: float
    limit: Limit
    op: OpView | None = None
    # The local ranks the wait was judged idle on (the shorter limit of `_idle_wait`), if any.
    idle: tuple[int, ...] = ()

    def describe(self) -> str:
        what = f"in {self.op.describe()}" if self.op else "without progress"
        return (
            f"rank {self.rank} {what} for {self.age:.1f} s > limit {self.limit.seconds:.1f} s "
            f"({self.limit.basis})"
        )


def _limits(obs: Observation, policy: TimeoutPolicy) -> dict[int, Limit]:
    settled = settled_at(obs.ranks, policy)
    return {
        r.rank: rank_limit(r, policy, obs.pg_timeout, settled, obs.now)
        for r in obs.ranks
        if r.alive
    }


def _overdue(
    r: RankSnapshot, obs: Observation, limits: dict[int, Limit], policy: TimeoutPolicy
) -> Overdue | None:
    limit = limits[r.rank]
    op = r.oldest_pending
    if op is not None:
        members = obs.groups.get(op.group, ())
        if r.phase and waits_outside_phases(r, op, members, obs):
            # Its own phase covers its own work in it, not a wait for ranks outside any phase:
            # a flash save's agreement each step would otherwise hold a rank that stopped
            # before its save to the phase's limit (capped by the collective timeout only).
            own = rank_limit(
                replace(r, phase="", phase_since=None),
                policy,
                obs.pg_timeout,
                settled_at(obs.ranks, policy),
                obs.now,
            )
            limit = Limit(own.seconds, f"{own.basis}; waiting in phase {r.phase!r}")
        # Waiting for members that are in a phase or warming up: their longer limit applies.
        for m in members:
            other = limits.get(m) if m != r.rank else None
            if other is not None and other.seconds > limit.seconds:
                limit = Limit(other.seconds, f"{other.basis} on rank {m}, which it waits for")
        # Whatever the limit, act before torch aborts this group's collective: the stacks would
        # no longer show where the ranks were stuck.
        torch_timeout = obs.group_timeouts.get(op.group, 0.0)
        if torch_timeout > 0 and limit.seconds > torch_timeout * PG_TIMEOUT_MARGIN:
            limit = Limit(
                torch_timeout * PG_TIMEOUT_MARGIN,
                f"{PG_TIMEOUT_MARGIN:.0%} of group {op.group}'s collective timeout",
            )
        # The wait is stuck only while the members it waits for are: any sign of progress from
        # one of them (it left a phase, issued an op, joined this one) restarts the clock. A
        # rank leaving a long eval and then joining the barrier is not a hang of the others.
        start = op.t_enqueue
        for m in members:
            other_rank = obs.find(m) if m != r.rank else None
            if other_rank is not None and other_rank.alive:
                start = max(start, min(other_rank.last_activity, obs.now))
        age = obs.now - start
        if age > limit.seconds:
            return Overdue(r.rank, OverdueKind.PENDING_OP, age, limit, op)
        return _idle_wait(r, op, members, obs, policy, start, limit)
    # A rank outside any collective blocks nobody until the others wait for it, and then their
    # pending ops trip the adaptive limit. On its own it may legitimately compute, save or log
    # for a long time, so it is held to the ceiling (or its phase limit, if longer).
    ceiling = effective_ceiling(policy, obs.pg_timeout)
    if limit.seconds < ceiling:
        limit = Limit(ceiling, "ceiling (no collective in flight)")
    age = obs.now - r.last_activity
    if age > limit.seconds:
        return Overdue(r.rank, OverdueKind.NO_PROGRESS, age, limit)
    return None


def _idle_wait(
    r: RankSnapshot,
    op: OpView,
    members: tuple[int, ...],
    obs: Observation,
    policy: TimeoutPolicy,
    start: float,
    limit: Limit,
) -> Overdue | None:
    """`r` waits in `op` for local members that sit idle outside any collective: no op, no
    phase, next to no CPU (theirs or their children's) and no I/O since before the wait's clock
    began (observe/idleness.py). Such a member is stuck (asleep, blocked on a lock, a queue, a
    socket), not slow: a slow step computes or reads. The wait is held to `idle_factor` x the
    same pace instead of `factor` x it; members on other nodes are left to their own agents.
    None when the rule does not apply or the wait is within it."""
    # Asked for every waiting rank at every look: while no other local rank idles (a training
    # job's usual state), it costs one pass over the local ranks, not one over a group's members.
    if (
        policy.idle_factor <= 0
        or r.phase
        or not any(x.idle_since is not None for x in obs.ranks if x is not r)
    ):
        return None
    behind: list[RankSnapshot] = []
    for other in obs.ranks:
        if (
            other is r
            or other.rank not in members
            or any(p.group == op.group and p.group_seq == op.group_seq for p in other.pending)
        ):
            continue  # not a member, or it joined (members on other nodes are not in obs.ranks)
        if not other.alive or other.phase or other.pending or other.idle_since is None:
            return None  # it computes, reads, is in a phase or waits elsewhere: not idle
        behind.append(other)
    if not behind:
        return None
    quick = replace(policy, factor=policy.idle_factor)
    settled = settled_at(obs.ranks, policy)
    idle = max(
        (rank_limit(x, quick, obs.pg_timeout, settled, obs.now) for x in (r, *behind)),
        key=lambda lim: lim.seconds,
    )
    if idle.seconds >= limit.seconds:
        return None  # warm-up or the floor: the idle rule is no quicker
    since = max(start, *(b.idle_since or start for b in behind))
    age = obs.now - since
    if age <= idle.seconds:
        return None
    behind.sort(key=lambda b: b.rank)
    who = ", ".join(str(b.rank) for b in behind)
    return Overdue(
        r.rank,
        OverdueKind.PENDING_OP,
        age,
        Limit(
            idle.seconds,
            f"{idle.basis}; rank{'s' if len(behind) > 1 else ''} {who} idle (no CPU, no I/O) "
            f"outside any collective for {age:.1f} s",
        ),
        op,
        tuple(b.rank for b in behind),
    )


def overdue_ranks(
    obs: Observation, timeouts: TimeoutPolicy
) -> tuple[dict[int, Limit], tuple[Overdue, ...]]:
    """Every live rank's current limit, and the ranks over it: what the hang rule sees now."""
    limits = _limits(obs, timeouts)
    overdue = tuple(o for r in obs.ranks if r.alive if (o := _overdue(r, obs, limits, timeouts)))
    return limits, overdue
