"""The agent's decision core: observation and state in, verdict and actions out.

Pure: no clocks (time comes in the observation), no I/O, no logging. The daemon executes the
actions and logs the events. Rules:
- a rank died (or failed) without closing its journal: an incident at once;
- a rank closed its journal (ended, or left the process group) while others went on to ops that
  need it: an incident at once, naming it, before any rank that failed after it (leaver.py);
- a rank's oldest pending op is older than its limit: a hang;
- a rank waits for local ranks that sit idle outside any collective (no CPU, no I/O) for longer
  than a smaller multiple of the pace: a hang sooner (overdue.py), backed off when it recurs;
- a rank outside any collective made no progress for longer than the ceiling: no-progress (a
  rank that others wait for is caught sooner, through their pending ops);
- a rank waiting in a collective inherits the longest limit among the members it waits for, so
  ranks waiting at a barrier while rank 0 evaluates are not called hung; its own phase does not
  lengthen a wait for members outside any phase (a rank in its flash save waiting for one that
  stopped before its own is held to the adaptive limit);
- one incident at a time: a new one may open only after progress resumes or the ranks restart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from diag.agent.detect.culprit import Suspect, SuspectKind, Wait, find_suspects, waits
from diag.agent.detect.deadlock import NO_ONE_STANDS_OUT
from diag.agent.detect.leaver import Leaver, find_leavers
from diag.agent.detect.observation import Liveness, Observation, RankSnapshot
from diag.agent.detect.overdue import IDLE_BACKOFF_S, Overdue, backed_off, overdue_ranks
from diag.agent.detect.timeouts import TimeoutPolicy, rank_limit, settled_at, stepless
from diag.formats.worlds import era


class VerdictKind(enum.Enum):
    HANG = "hang"  # ranks wait in a collective beyond the limit
    NO_PROGRESS = "no_progress"  # no rank waits in a collective, yet nothing moves
    RANK_EXITED = "rank_exited"  # a rank died while the others run


# A node whose ranks only wait for other nodes' asks them to recover this much later: the
# culprit's node judges at the same limit and, asked first, takes its stuck rank out (a rank
# stuck in C is stopped, not interrupted); asked first here, the culprit's peers would leave
# their collective and the culprit's node would see no rank waiting for it (a no-progress
# verdict, up to 5 slow steps later). The fault reaches these ranks through the store anyway.
REMOTE_DEFER_S = 5.0


class OnHang(enum.Enum):
    NONE = "none"  # evidence only
    STOP = "stop"  # evidence, then SIGTERM the local ranks (SIGKILL after a grace period)
    # evidence, then the local ranks asked to recover in place (diag.trainer.resilient); those
    # that cannot are stopped as with STOP
    RECOVER = "recover"


class ActionKind(enum.Enum):
    CAPTURE_EVIDENCE = "capture-evidence"
    PERSIST_CHECKPOINT = "persist-checkpoint"
    STOP_RANKS = "stop-ranks"
    RECOVER_RANKS = "recover-ranks"


class EventKind(enum.Enum):
    INCIDENT = "incident"
    RECOVERED = "recovered"  # progress resumed after an incident
    NEW_ATTEMPT = "new-attempt"  # the ranks restarted
    JOB_ENDED = "job-ended"
    NO_STEPS = "no-steps"  # ranks mark no steps: their op pace ended warm-up (once per attempt)


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    incident_id: str
    at: float  # monotonic time of the decision
    culprit: int | None
    suspects: tuple[Suspect, ...]
    overdue: tuple[Overdue, ...]
    waits: tuple[Wait, ...]
    summary: str
    expired_at: float | None = None  # when the first limit ran out (for latency accounting)


@dataclass(frozen=True)
class Policy:
    timeouts: TimeoutPolicy = field(default_factory=TimeoutPolicy)
    on_hang: OnHang = OnHang.NONE
    persist_on_incident: bool = False


@dataclass(frozen=True)
class WatchState:
    attempt: int = -1
    incident: Verdict | None = None
    activity_at_incident: tuple[tuple[int, float], ...] = ()
    job_ended: bool = False
    warned_no_steps: bool = False
    # When the last incident ended (progress resumed): no rank is judged on the time before it.
    # A world recovered in place goes on in the same attempt, each rank only once it has torn
    # down its last generation and formed the next.
    resumed_at: float | None = None
    # When the idle rule gave a verdict, across attempts (overdue.IDLE_BACKOFF_S).
    idle_verdicts: tuple[float, ...] = ()


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    verdict: Verdict
    ranks: tuple[int, ...] = ()
    delay_s: float = 0.0  # RECOVER_RANKS: asked this much later (see REMOTE_DEFER_S)


@dataclass(frozen=True)
class Event:
    kind: EventKind
    message: str


@dataclass(frozen=True)
class Decision:
    state: WatchState
    verdict: Verdict | None = None
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()


def decide(state: WatchState, obs: Observation, policy: Policy) -> Decision:
    events: list[Event] = []
    if obs.attempt != state.attempt:
        if state.attempt >= 0:
            events.append(Event(EventKind.NEW_ATTEMPT, f"ranks restarted (attempt {obs.attempt})"))
        state = WatchState(attempt=obs.attempt, idle_verdicts=state.idle_verdicts)
    if not obs.ranks:
        return Decision(state, events=tuple(events))
    if not state.warned_no_steps:
        warning = _no_steps_warning(obs, policy.timeouts)
        if warning is not None:
            events.append(warning)
            state = replace(state, warned_no_steps=True)

    if state.incident is not None:
        if _progressed_since(state, obs):
            events.append(Event(EventKind.RECOVERED, "progress resumed after the incident"))
            state = replace(state, incident=None, activity_at_incident=(), resumed_at=obs.now)
        else:
            return Decision(_job_end(state, obs, events), events=tuple(events))

    recent = tuple(t for t in state.idle_verdicts if obs.now - t < IDLE_BACKOFF_S)
    verdict = _rank_exit_verdict(obs) or _hang_verdict(
        _since(obs, state.resumed_at),
        replace(policy, timeouts=backed_off(policy.timeouts, len(recent))),
    )
    if verdict is None:
        return Decision(_job_end(state, obs, events), events=tuple(events))
    if any(o.idle for o in verdict.overdue):
        state = replace(state, idle_verdicts=(*recent, obs.now))

    return open_incident(state, obs, policy, verdict, events)


def open_incident(
    state: WatchState,
    obs: Observation,
    policy: Policy,
    verdict: Verdict,
    events: list[Event] | tuple[Event, ...] = (),
) -> Decision:
    """An incident opened under `verdict`, this node's own or one of the job's that another
    node reported (`job/jobstop.py`): evidence, checkpoints, then (`--on-hang stop`) the live
    ranks stopped, or (`--on-hang recover`) asked to recover in place, and then the checkpoints:
    ranks that recover keep their memory, so the write to storage (seconds per GB) need not
    hold up their recovery. Until progress resumes or the ranks restart, no other incident
    opens."""
    actions = [Action(ActionKind.CAPTURE_EVIDENCE, verdict)]
    persist = [Action(ActionKind.PERSIST_CHECKPOINT, verdict)] if policy.persist_on_incident else []
    alive = tuple(sorted(r.rank for r in obs.ranks if r.alive))
    if policy.on_hang == OnHang.RECOVER and alive:
        delay = REMOTE_DEFER_S if blames_other_nodes(verdict) else 0.0
        actions += [Action(ActionKind.RECOVER_RANKS, verdict, alive, delay), *persist]
    else:
        actions += persist
        if policy.on_hang == OnHang.STOP and alive:
            actions.append(Action(ActionKind.STOP_RANKS, verdict, alive))
    state = replace(
        state,
        incident=verdict,
        activity_at_incident=tuple((r.rank, r.last_activity) for r in obs.ranks),
    )
    return Decision(
        state, verdict, tuple(actions), (*events, Event(EventKind.INCIDENT, verdict.summary))
    )


def blames_other_nodes(verdict: Verdict) -> bool:
    """The local ranks only wait for ranks on other nodes: the culprit's node judges it too."""
    return (
        verdict.culprit is None
        and bool(verdict.suspects)
        and all(s.kind == SuspectKind.REMOTE for s in verdict.suspects)
    )


def _no_steps_warning(obs: Observation, timeouts: TimeoutPolicy) -> Event | None:
    """Said once: a job that marks no steps is judged on the pace of its ops, not on steps."""
    ranks = [r for r in obs.ranks if r.alive and stepless(r)]
    if not ranks:
        return None
    first = ranks[0]
    limit = rank_limit(first, timeouts, obs.pg_timeout, settled_at(obs.ranks, timeouts), obs.now)
    held = first.cadence.steady_over if first.cadence is not None else 0.0
    which = (
        f"ranks {','.join(str(r.rank) for r in ranks)}" if len(ranks) > 1 else f"rank {first.rank}"
    )
    return Event(
        EventKind.NO_STEPS,
        f"{which} mark no training steps (no engine given to diag.trainer.attach(), no "
        f"diag.trainer.step()); their ops have completed at a steady pace for {held:.0f} s, so "
        f"the {timeouts.warmup_timeout:g} s warm-up limit no longer applies: hang limit of rank "
        f"{first.rank} now {limit.seconds:.1f} s ({limit.basis}). Call diag.trainer.step() at "
        "each step boundary for limits based on steps",
    )


def _progressed_since(state: WatchState, obs: Observation) -> bool:
    """A live rank moved after the incident, and no dead or failed rank is still in view (the
    observer stops showing ranks that ended a while ago, so a relaunched job can recover), nor a
    rank that left while the others need it."""
    before = dict(state.activity_at_incident)
    moved = any(r.alive and r.last_activity > before.get(r.rank, float("-inf")) for r in obs.ranks)
    # A rank that failed after the incident (its collective broken by the stop of ranks
    # elsewhere, or by its own) is as dead as one killed: its last record is no progress.
    if not moved or any(r.liveness in (Liveness.DIED, Liveness.FAILED) for r in obs.ranks):
        return False
    return (
        state.incident is None
        or state.incident.culprit is None
        or not any(lv.rank.rank == state.incident.culprit for lv in find_leavers(obs))
    )


def _job_end(state: WatchState, obs: Observation, events: list[Event]) -> WatchState:
    if not state.job_ended and all(not r.alive for r in obs.ranks):
        events.append(Event(EventKind.JOB_ENDED, _end_message(obs)))
        return replace(state, job_ended=True)
    return state


def _end_message(obs: Observation) -> str:
    counts: dict[str, int] = {}
    for r in obs.ranks:
        counts[r.liveness.value] = counts.get(r.liveness.value, 0) + 1
    return "all local ranks ended: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def _incident_id(obs: Observation, kind: VerdictKind, ws: list[Wait]) -> str:
    # Agents on other nodes see the same stuck collective, so (group, seq) makes the id they
    # share; directories of one incident are grouped by it when merged.
    where = f"pg{ws[0].group}-seq{ws[0].group_seq}" if ws else "noop"
    if ws and ws[0].pair is not None:
        where += f"-p2p{ws[0].pair[0]}-{ws[0].pair[1]}"
    return f"{era(obs.attempt, obs.world)}-{kind.value}-{where}"


def _rank_exit_verdict(obs: Observation) -> Verdict | None:
    leavers = [lv for lv in find_leavers(obs) if obs.rank(lv.rank.rank) is not None]
    if leavers:
        return _leaver_verdict(obs, leavers[0])
    dead = [r for r in obs.ranks if r.liveness in (Liveness.DIED, Liveness.FAILED)]
    if not dead:
        return None
    # Exits seen at one wake-up (a busy node wakes the agent late) are told apart by how: a rank
    # killed without a word comes before one whose exception says its collective broke.
    first = min(dead, key=lambda r: (_exit_time(r, obs.now), r.liveness != Liveness.DIED, r.rank))
    suspects = [s for s in find_suspects(obs) if s.rank != first.rank]
    how = "failed with an uncaught exception" if first.liveness == Liveness.FAILED else "died"
    lead = Suspect(
        first.rank,
        SuspectKind.DIED,
        f"rank {first.rank} (pid {first.pid}) {how} first"
        + (
            f", during {first.pending[0].describe()}" if first.pending else f" at step {first.step}"
        ),
    )
    others = [r.rank for r in dead if r is not first]
    tail = f"; ranks {','.join(map(str, others))} ended after it" if others else ""
    return _exit_verdict(obs, first.rank, (lead, *suspects), f"rank {first.rank} {how}{tail}",
                         first.exited_at)  # fmt: skip


def _exit_time(r: RankSnapshot, now: float) -> float:
    return r.exited_at if r.exited_at is not None else now


def _leaver_verdict(obs: Observation, lv: Leaver) -> Verdict:
    """A local rank left while others went on to ops that need it: whatever happens to them next
    (they fail, hang or are killed) is its consequence, so it is named at once, as a death is."""
    suspects = find_suspects(obs)
    lead = next(s for s in suspects if s.rank == lv.rank.rank)
    dead = [r.rank for r in obs.ranks if r.liveness in (Liveness.DIED, Liveness.FAILED)]
    tail = f"; ranks {','.join(map(str, dead))} ended after it" if dead else ""
    rest = tuple(s for s in suspects if s is not lead)
    return _exit_verdict(obs, lv.rank.rank, (lead, *rest), lead.reason + tail, lv.ended_at)


def _exit_verdict(
    obs: Observation,
    culprit: int,
    suspects: tuple[Suspect, ...],
    summary: str,
    expired_at: float | None,
) -> Verdict:
    return Verdict(
        kind=VerdictKind.RANK_EXITED,
        # One id per attempt, not per rank: when ranks on several nodes die in one cascade,
        # each node's agent names the same incident whichever rank it saw die first.
        incident_id=f"{era(obs.attempt, obs.world)}-{VerdictKind.RANK_EXITED.value}",
        at=obs.now,
        culprit=culprit,
        suspects=suspects,
        overdue=(),
        waits=tuple(waits(obs)),
        summary=summary,
        expired_at=expired_at,
    )


def _no_one_stands_out(suspects: list[Suspect]) -> bool:
    """The leading suspects are the ranks of one deadlock, none of which stands out."""
    return (
        bool(suspects)
        and suspects[0].kind == SuspectKind.DEADLOCK
        and (NO_ONE_STANDS_OUT in suspects[0].reason)
    )


def _span(ranks: list[int]) -> str:
    """ranks 2, 3 / ranks 8-15 / rank 4: short for a whole remote node."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _since(obs: Observation, resumed_at: float | None) -> Observation:
    """The observation with every rank's clock started no earlier than `resumed_at`."""
    if resumed_at is None or all(r.last_activity >= resumed_at for r in obs.ranks):
        return obs
    ranks = tuple(
        r if r.last_activity >= resumed_at else replace(r, last_activity=resumed_at)
        for r in obs.ranks
    )
    return replace(obs, ranks=ranks)


def _hang_verdict(obs: Observation, policy: Policy) -> Verdict | None:
    _, overdue = overdue_ranks(obs, policy.timeouts)
    if not overdue:
        return None
    ws = waits(obs)
    suspects = find_suspects(obs)
    if not suspects:
        # Nobody waits for anybody: the ranks without progress are the suspects themselves.
        suspects = [
            Suspect(o.rank, SuspectKind.BEHIND_IDLE, o.describe())
            for o in sorted(overdue, key=lambda o: -o.age)
        ]
    kind = VerdictKind.HANG if ws else VerdictKind.NO_PROGRESS
    culprit = suspects[0].rank if suspects else None
    first = max(overdue, key=lambda o: o.age - o.limit.seconds)
    lead = suspects[0].reason if suspects else first.describe()
    if suspects and suspects[0].kind == SuspectKind.REMOTE:
        # Only ranks on other nodes can be behind: which of them, this node cannot tell. The
        # job verdict weighs every node's view of its ranks and names it.
        culprit = None
        remote = sorted(s.rank for s in suspects if s.kind == SuspectKind.REMOTE)
        where = f" in {ws[0].describe()}" if ws else ""
        lead = (
            f"the local ranks wait{where} for ranks on other nodes ({_span(remote)}): "
            "the job verdict names the culprit"
        )
    elif _no_one_stands_out(suspects):
        # A deadlock of ranks that all did the same thing (each receives before it sends):
        # naming one of them would send the reader after the wrong rank.
        culprit = None
        lead = f"no single culprit: {lead}"
    summary = f"{kind.value}: " + (
        f"rank {culprit} is the likely culprit: {lead}" if culprit is not None else lead
    )
    return Verdict(
        kind=kind,
        incident_id=_incident_id(obs, kind, ws),
        at=obs.now,
        culprit=culprit,
        suspects=tuple(suspects),
        overdue=tuple(sorted(overdue, key=lambda o: o.rank)),
        waits=tuple(ws),
        summary=summary,
        expired_at=obs.now - (first.age - first.limit.seconds),
    )
