"""The agent's drain on SIGTERM (or an early preemption notice): the pure decision core.

A pod being deleted gets SIGTERM, then SIGKILL `terminationGracePeriodSeconds` later. The agent
uses that time to get the ranks' newest state onto storage:

1. every connected local rank gets EXIT (a flush first: the ranks save a flash checkpoint at the
   next step boundary, all at the same step, ask for its persist and leave); meanwhile the
   newest complete snapshot already in memory (the last step every rank completed) is persisted
   at once, so that step is committed whatever happens to the ranks next;
2. the agent waits until every rank has either left or had the step it saved persisted;
3. once the persists in flight are done, it persists every complete snapshot still newer than
   storage (a rank that died at SIGTERM without saving leaves its previous snapshots), commits;
4. if the ranks cannot reach a step boundary before `rank_deadline` (a long step, a hang), it
   persists the newest complete snapshot it already has and stops them;
5. it is done; at `deadline` (the grace period less a margin) it gives up on whatever is left.

Both Kubernetes orders come out of the same rules: a classic sidecar gets SIGTERM with the trainer
(ranks still running: steps 1-3), a native sidecar only after the trainer container has exited
(no rank left: step 3 at once).

Pure: job views and `now` in, the new state, actions and events out. `executor.py` executes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

DEFAULT_GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds
DEFAULT_MARGIN_S = 3.0  # kept for the agent's own exit (and the kubelet's clock skew)
MIN_PERSIST_BUDGET_S = 5.0  # also covers stopping the ranks and the launcher's exit after
DEFAULT_PERSIST_RATE = 100e6  # bytes/s assumed for storage before a persist was measured
PERSIST_BUDGET_SAFETY = 1.5


@dataclass(frozen=True)
class DrainSettings:
    grace: float = DEFAULT_GRACE_S  # seconds between SIGTERM and SIGKILL
    margin: float = DEFAULT_MARGIN_S
    # SIGTERM to SIGKILL when stopping ranks that reached no boundary: they had EXIT (and in a
    # pod deletion the launcher's SIGTERM) already, and their launcher needs time to exit too.
    stop_grace: float = 0.5

    def __post_init__(self) -> None:
        if not self.grace > 0:
            raise ValueError(f"the termination grace must be positive, not {self.grace}")
        if not 0 <= self.margin < self.grace:
            raise ValueError(
                f"the drain margin ({self.margin} s) must be at least 0 and shorter than the "
                f"termination grace ({self.grace} s)"
            )


@dataclass(frozen=True)
class RankView:
    rank: int
    alive: bool  # its process runs (or, not visible to the agent, its stream is open)
    connected: bool  # its control stream is open: it can get a command
    reported_step: int | None = None  # the step it saved on our EXIT, once it said so
    persisted_step: int | None = None  # its newest part on storage


@dataclass(frozen=True)
class JobView:
    job: str
    ranks: tuple[RankView, ...]
    in_flight: int = 0  # persists queued or running
    newest_unpersisted: int | None = None  # newest complete snapshot step not on storage
    unpersisted_bytes: int = 0  # what persisting everything newer than storage would write
    committed: int | None = None


class Phase(enum.Enum):
    WAITING = "waiting"  # for the ranks to save and leave
    FINISHING = "finishing"  # every job settled: persists in flight finish
    DONE = "done"


class ActionKind(enum.Enum):
    SEND_EXIT = "send_exit"  # EXIT to these ranks of the job
    PERSIST = "persist"  # every complete snapshot of the job newer than storage, now
    STOP_RANKS = "stop_ranks"  # SIGTERM, then SIGKILL, to these ranks' processes


@dataclass(frozen=True)
class DrainAction:
    kind: ActionKind
    job: str
    ranks: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class DrainEvent:
    message: str
    warning: bool = False


@dataclass(frozen=True)
class DrainState:
    reason: str  # "SIGTERM", "aws spot instance-action: terminate at ..."
    started: float
    deadline: float  # the agent is done by then, whatever is left
    rank_deadline: float  # ranks that have not settled by then are given up on
    phase: Phase = Phase.WAITING
    exit_sent: frozenset[tuple[str, int]] = frozenset()
    persisted_upto: tuple[tuple[str, int], ...] = ()  # job -> newest step a PERSIST covered
    given_up: frozenset[str] = frozenset()  # jobs whose ranks missed the rank deadline
    stopped: frozenset[tuple[str, int]] = frozenset()
    outcome: str = ""  # set with DONE: how it ended

    def persisted(self, job: str) -> int | None:
        return dict(self.persisted_upto).get(job)


@dataclass(frozen=True)
class Decision:
    state: DrainState
    actions: tuple[DrainAction, ...] = ()
    events: tuple[DrainEvent, ...] = ()


def persist_budget(
    nbytes: int, rate: float | None, window: float, minimum: float = MIN_PERSIST_BUDGET_S
) -> float:
    """Seconds to keep for writing `nbytes` to storage at the measured `rate` (bytes/s), with a
    safety factor; at least `minimum`, at most half of the `window` (the ranks get the rest)."""
    rate = rate if rate and rate > 0 else DEFAULT_PERSIST_RATE
    need = max(minimum, PERSIST_BUDGET_SAFETY * nbytes / rate)
    return max(0.0, min(need, window / 2))


def start(
    reason: str,
    now: float,
    settings: DrainSettings,
    *,
    deadline: float | None = None,
    persist_bytes: int = 0,
    persist_rate: float | None = None,
) -> DrainState:
    """A drain beginning at `now`. `deadline` (an early notice's reclaim time, less the margin)
    overrides the grace period's; `persist_bytes` is what the node's ranks hold in memory."""
    end = now + settings.grace - settings.margin if deadline is None else deadline
    end = max(end, now)
    budget = persist_budget(persist_bytes, persist_rate, end - now)
    return DrainState(reason=reason, started=now, deadline=end, rank_deadline=end - budget)


def tighten(
    state: DrainState,
    reason: str,
    now: float,
    settings: DrainSettings,
    *,
    deadline: float | None = None,
    persist_bytes: int = 0,
    persist_rate: float | None = None,
) -> DrainState:
    """A second request during a drain (SIGTERM while an early notice's drain runs: the kubelet
    SIGKILLs `grace` after its SIGTERM, whatever the notice said). The earlier end wins; the
    ranks' deadline moves with it, so ranks stuck in a long step are still stopped in time."""
    fresh = start(
        reason, now, settings, deadline=deadline, persist_bytes=persist_bytes,
        persist_rate=persist_rate,
    )  # fmt: skip
    if fresh.deadline >= state.deadline or state.phase == Phase.DONE:
        return state
    return replace(
        state,
        reason=f"{state.reason}, then {reason}",
        deadline=fresh.deadline,
        rank_deadline=min(state.rank_deadline, fresh.rank_deadline),
    )


def rank_settled(r: RankView) -> bool:
    """Left, or still there with the step it saved for us on storage (a job that keeps running
    after EXIT, exit_on_command=False)."""
    if not r.alive:
        return True
    return (
        r.reported_step is not None
        and r.persisted_step is not None
        and r.persisted_step >= r.reported_step
    )


def decide(state: DrainState, jobs: tuple[JobView, ...], now: float) -> Decision:
    if state.phase == Phase.DONE:
        return Decision(state)
    actions: list[DrainAction] = []
    events: list[DrainEvent] = []

    if now >= state.deadline:
        left = _leftovers(state, jobs)
        outcome = "deadline reached" + (f": {left}" if left else "")
        events.append(DrainEvent(f"drain ({state.reason}): {outcome}", warning=bool(left)))
        return Decision(replace(state, phase=Phase.DONE, outcome=outcome), (), tuple(events))

    exit_sent = set(state.exit_sent)
    persisted = dict(state.persisted_upto)
    given_up = set(state.given_up)
    stopped = set(state.stopped)
    past_ranks = now >= state.rank_deadline

    for job in jobs:
        # 1. EXIT to every connected rank not told yet (also ranks that connect meanwhile).
        todo = tuple(
            r.rank
            for r in job.ranks
            if r.connected and r.alive and (job.job, r.rank) not in exit_sent
            and job.job not in given_up
        )  # fmt: skip
        if todo:
            actions.append(DrainAction(ActionKind.SEND_EXIT, job.job, todo, state.reason))
            exit_sent.update((job.job, r) for r in todo)

        unsettled = [r for r in job.ranks if not rank_settled(r)]
        if unsettled and job.job not in persisted and job.newest_unpersisted is not None:
            # What every rank completed before the drain goes to storage while they finish.
            actions.append(DrainAction(ActionKind.PERSIST, job.job, reason="newest in memory"))
            persisted[job.job] = _covered(job)
        if unsettled and past_ranks and job.job not in given_up:
            # 4. Out of time for a step boundary: what is in memory goes to storage, then the
            # ranks are stopped (they would be killed with nothing saved otherwise).
            given_up.add(job.job)
            ranks = ", ".join(str(r.rank) for r in unsettled)
            events.append(
                DrainEvent(
                    f"drain: ranks {ranks} of {job.job} reached no step boundary in "
                    f"{now - state.started:.1f} s: persisting the newest complete snapshot in "
                    "memory and stopping them",
                    warning=True,
                )
            )
            if job.newest_unpersisted is not None and job.newest_unpersisted > persisted.get(
                job.job, -1
            ):
                actions.append(
                    DrainAction(ActionKind.PERSIST, job.job, reason="ranks gave no step")
                )
                persisted[job.job] = _covered(job)
            alive = tuple(r.rank for r in unsettled if r.alive)
            if alive:
                actions.append(
                    DrainAction(ActionKind.STOP_RANKS, job.job, alive, "no step boundary in time")
                )
                stopped.update((job.job, r) for r in alive)
            continue
        if unsettled and job.job not in given_up:
            continue
        # 3. Settled (or given up on), the ranks' own persist requests done: anything newer than
        # storage that no PERSIST covered yet.
        if job.in_flight and job.job not in given_up:
            continue
        if job.newest_unpersisted is not None and (
            job.job not in persisted or job.newest_unpersisted > persisted[job.job]
        ):
            actions.append(DrainAction(ActionKind.PERSIST, job.job, reason=state.reason))
            persisted[job.job] = _covered(job)

    new = replace(
        state,
        exit_sent=frozenset(exit_sent),
        persisted_upto=tuple(sorted(persisted.items())),
        given_up=frozenset(given_up),
        stopped=frozenset(stopped),
    )
    settled = all(job.job in given_up or all(rank_settled(r) for r in job.ranks) for job in jobs)
    if not settled:
        return Decision(new, tuple(actions), tuple(events))
    busy = [
        j for j in jobs
        if j.in_flight
        or (j.newest_unpersisted is not None and j.newest_unpersisted > persisted.get(j.job, -1))
        or any(r.alive for r in j.ranks if (j.job, r.rank) in stopped)
    ]  # fmt: skip
    if actions or busy:
        return Decision(replace(new, phase=Phase.FINISHING), tuple(actions), tuple(events))
    committed = ", ".join(
        f"{j.job} step {j.committed}" for j in jobs if j.committed is not None
    )  # fmt: skip
    outcome = f"done in {now - state.started:.1f} s" + (
        f"; committed: {committed}" if committed else ""
    )
    events.append(DrainEvent(f"drain ({state.reason}): {outcome}"))
    return Decision(replace(new, phase=Phase.DONE, outcome=outcome), (), tuple(events))


def _covered(job: JobView) -> int:
    return job.newest_unpersisted if job.newest_unpersisted is not None else -1


def _leftovers(state: DrainState, jobs: tuple[JobView, ...]) -> str:
    parts = []
    for j in jobs:
        unsettled = [r.rank for r in j.ranks if not rank_settled(r)]
        if unsettled:
            parts.append(f"{j.job} ranks {','.join(map(str, unsettled))} still running")
        if j.in_flight:
            parts.append(f"{j.job}: {j.in_flight} persist(s) unfinished")
        if j.newest_unpersisted is not None and j.newest_unpersisted > state_persisted(state, j):
            parts.append(f"{j.job} step {j.newest_unpersisted} not persisted")
    return "; ".join(parts)


def state_persisted(state: DrainState, job: JobView) -> int:
    got = state.persisted(job.job)
    return -1 if got is None else got


@dataclass(frozen=True)
class DrainRequest:
    """What asked for a drain (a signal, or the early-notice watcher), handed to the main loop."""

    reason: str
    at: float  # time.monotonic() of the request
    deadline: float | None = None  # monotonic; None: the grace period from `at`
    exit_after: bool = True  # SIGTERM: exit when done; an early notice: keep watching
