"""Table-driven tests of the pure decision core: timeouts, culprit analysis, hang rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from diag.agent.detect.culprit import SuspectKind, find_suspects
from diag.agent.detect.hang import (
    REMOTE_DEFER_S,
    ActionKind,
    EventKind,
    OnHang,
    Policy,
    VerdictKind,
    WatchState,
    decide,
)
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.detect.straggler import straggler_scores
from diag.agent.detect.timeouts import TimeoutPolicy, rank_limit
from diag.formats.records import OpCode, OpState

NOW = 1000.0
POLICY = TimeoutPolicy(
    ceiling=60.0,
    floor=2.0,
    factor=5.0,
    warmup_steps=2,
    warmup_timeout=120.0,
    phase_timeouts={"eval": 600.0},
)


def op(
    seq: int,
    t: float,
    state: OpState = OpState.ENQUEUED,
    group: str = "0",
    code: OpCode = OpCode.ALL_REDUCE,
    nbytes: int = 1024,
    t_end: float | None = None,
) -> OpView:
    return OpView(group, seq, code, state, nbytes, t, t_end)


def rank(
    r: int,
    *,
    last: float = NOW - 0.1,
    step: int = 10,
    pending: tuple = (),
    last_seq: int | None = None,
    group: str = "0",
    durations: tuple = (0.5, 0.5),
    liveness: Liveness = Liveness.RUNNING,
    phase: str = "",
    exited_at: float | None = None,
    cpu: float = 0.0,
    state: str = "S",
) -> RankSnapshot:
    last_ops = {}
    if pending:
        last_ops = {p.group: p for p in pending}
    elif last_seq is not None:
        last_ops = {group: op(last_seq, last - 0.1, OpState.COMPLETED, group, t_end=last)}
    return RankSnapshot(
        rank=r,
        local_rank=r,
        pid=100 + r,
        node="n",
        liveness=liveness,
        started_at=0.0,
        last_activity=last,
        step=step,
        phase=phase,
        pending=tuple(pending),
        last_ops=last_ops,
        step_durations=durations,
        exited_at=exited_at,
        cpu_busy=cpu,
        proc_state=state,
    )


def obs(
    *ranks: RankSnapshot, groups: dict | None = None, attempt: int = 0, pg_timeout: float = 0.0
) -> Observation:
    world = max(r.rank for r in ranks) + 1
    return Observation(
        now=NOW,
        ranks=tuple(ranks),
        groups=groups or {"0": tuple(range(world))},
        world_size=world,
        attempt=attempt,
        pg_timeout=pg_timeout,
    )


@pytest.mark.parametrize(
    "snapshot, pg_timeout, seconds, basis",
    [
        (rank(0, durations=(0.5, 0.8)), 0.0, 4.0, "5 x slowest"),
        (rank(0, durations=(0.01,)), 0.0, 2.0, "floor"),
        (rank(0, durations=(30.0,)), 0.0, 60.0, "ceiling"),
        (rank(0, durations=(30.0,)), 50.0, 40.0, "ceiling"),  # 0.8 x the collective timeout
        (rank(0, durations=()), 0.0, 60.0, "no step timing"),
        (rank(0, step=1), 0.0, 120.0, "warm-up"),
        (rank(0, phase="eval"), 0.0, 600.0, "phase 'eval'"),
        (rank(0, phase="checkpoint"), 0.0, 1800.0, "phase 'checkpoint'"),  # the default
    ],
)
def test_rank_limit(snapshot: RankSnapshot, pg_timeout: float, seconds: float, basis: str) -> None:
    limit = rank_limit(snapshot, POLICY, pg_timeout)
    assert limit.seconds == pytest.approx(seconds)
    assert basis in limit.basis


def test_policy_rejects_floor_above_ceiling() -> None:
    with pytest.raises(ValueError, match="floor"):
        TimeoutPolicy(ceiling=5, floor=10)


def _decide(o: Observation, on_hang: OnHang = OnHang.NONE, state: WatchState | None = None):
    return decide(state or WatchState(), o, Policy(timeouts=POLICY, on_hang=on_hang))


def test_progressing_ranks_give_no_verdict() -> None:
    o = obs(*(rank(r, pending=(op(41, NOW - 0.2),)) for r in range(4)))
    assert _decide(o).verdict is None


def test_rank_behind_and_idle_is_the_culprit() -> None:
    waiting = [rank(r, last=NOW - 10, pending=(op(42, NOW - 10),)) for r in (0, 1, 3)]
    culprit = rank(2, last=NOW - 10, last_seq=41, cpu=1.0, state="R")
    d = _decide(obs(*waiting, culprit), OnHang.STOP)
    v = d.verdict
    assert v is not None and v.kind == VerdictKind.HANG and v.culprit == 2
    assert v.suspects[0].kind == SuspectKind.BEHIND_IDLE
    assert "busy on CPU" in v.suspects[0].reason and "#41" in v.suspects[0].reason
    assert [a.kind for a in d.actions] == [ActionKind.CAPTURE_EVIDENCE, ActionKind.STOP_RANKS]
    assert d.actions[1].ranks == (0, 1, 2, 3)
    assert v.incident_id == "a0-hang-pg0-seq42"
    assert v.expired_at == pytest.approx(NOW - 10 + 2.5)  # limit 5 x 0.5 s


def test_incident_ids_name_the_world_formed_again_in_place() -> None:
    """Within one attempt, each world recovery in place forms is an era of its own: its
    incidents, deaths included, are not those of the world before (decisions.era_of)."""
    waiting = [rank(r, last=NOW - 10, pending=(op(42, NOW - 10, group="0@2"),)) for r in (0, 1)]
    hung = replace(obs(*waiting, groups={"0@2": (0, 1)}, attempt=3), world=2)
    v = _decide(hung).verdict
    assert v is not None and v.incident_id == "a3g2-hang-pg0@2-seq42"
    died = replace(
        obs(rank(0), rank(1, liveness=Liveness.DIED, exited_at=NOW - 1), attempt=3), world=2
    )
    d = _decide(died).verdict
    assert d is not None and d.incident_id == "a3g2-rank_exited"


def test_on_hang_recover_asks_the_live_ranks_to_recover_in_place() -> None:
    waiting = [rank(r, last=NOW - 10, pending=(op(42, NOW - 10),)) for r in (0, 1, 3)]
    culprit = rank(2, last=NOW - 10, last_seq=41)
    dead = rank(4, liveness=Liveness.DIED, exited_at=NOW - 20, last=NOW - 20)
    d = _decide(obs(*waiting, culprit, dead), OnHang.RECOVER)
    assert d.verdict is not None
    assert [a.kind for a in d.actions] == [ActionKind.CAPTURE_EVIDENCE, ActionKind.RECOVER_RANKS]
    assert d.actions[1].ranks == (0, 1, 2, 3), "the live ranks: a dead one takes no command"
    assert d.actions[1].delay_s == 0.0, "the culprit is here: asked at once"
    # With checkpoints persisted on an incident: after the ask, not before (the ranks keep
    # their memory; under --on-hang stop the write comes first, before the processes go).
    policy = Policy(timeouts=POLICY, on_hang=OnHang.RECOVER, persist_on_incident=True)
    d = decide(WatchState(), obs(*waiting, culprit, dead), policy)
    assert [a.kind for a in d.actions] == [
        ActionKind.CAPTURE_EVIDENCE, ActionKind.RECOVER_RANKS, ActionKind.PERSIST_CHECKPOINT,
    ]  # fmt: skip
    policy = replace(policy, on_hang=OnHang.STOP)
    d = decide(WatchState(), obs(*waiting, culprit, dead), policy)
    assert [a.kind for a in d.actions] == [
        ActionKind.CAPTURE_EVIDENCE, ActionKind.PERSIST_CHECKPOINT, ActionKind.STOP_RANKS,
    ]  # fmt: skip


def test_on_hang_recover_waits_for_the_culprits_node_when_only_other_nodes_are_behind() -> None:
    # The culprit's node judges at the same limit and must see its ranks still waiting for it
    # (a rank stuck in C is stopped there, not interrupted): this node asks its ranks later.
    ranks = [rank(r, last=NOW - 10, pending=(op(5, NOW - 10),)) for r in range(2)]
    d = _decide(obs(*ranks, groups={"0": (0, 1, 2, 3)}), OnHang.RECOVER)
    assert d.verdict is not None and d.verdict.culprit is None
    recover = [a for a in d.actions if a.kind == ActionKind.RECOVER_RANKS]
    assert len(recover) == 1 and recover[0].ranks == (0, 1)
    assert recover[0].delay_s == REMOTE_DEFER_S > 0


def test_dead_rank_is_an_incident_at_once_and_first_to_die_is_culprit() -> None:
    o = obs(
        rank(0, pending=(op(42, NOW - 0.5),)),
        rank(1, liveness=Liveness.DIED, exited_at=NOW - 0.2),
        rank(2, liveness=Liveness.DIED, exited_at=NOW - 0.4, last_seq=41),
    )
    v = _decide(o).verdict
    assert v is not None and v.kind == VerdictKind.RANK_EXITED and v.culprit == 2
    assert "ranks 1 ended after it" in v.summary


def test_exits_seen_at_one_wake_up_name_the_rank_killed_before_the_rank_that_failed() -> None:
    # Rank 1 was killed; rank 0's collective broke and it raised: a late wake-up sees both.
    o = obs(
        rank(0, liveness=Liveness.FAILED, exited_at=NOW - 0.1),
        rank(1, liveness=Liveness.DIED, exited_at=NOW - 0.1),
        rank(2, pending=(op(42, NOW - 0.5),)),
    )
    v = _decide(o).verdict
    assert v is not None and v.culprit == 1 and "rank 1 died" in v.summary, v


def test_eval_phase_on_one_rank_does_not_make_the_waiters_hung() -> None:
    waiting = [rank(r, last=NOW - 100, pending=(op(42, NOW - 100),)) for r in (1, 2, 3)]
    evaluating = rank(0, last=NOW - 100, last_seq=41, phase="eval")
    assert _decide(obs(*waiting, evaluating)).verdict is None
    # ... but past the eval limit it is a hang, with rank 0 as culprit.
    late = [replace(w, pending=(op(42, NOW - 700),)) for w in waiting]
    v = _decide(obs(*late, replace(evaluating, last_activity=NOW - 700))).verdict
    assert v is not None and v.culprit == 0 and "phase 'eval'" in v.suspects[0].reason


def test_rank_leaving_a_phase_restarts_the_waiters_clock() -> None:
    # Rank 0 evaluated for 100 s while the others waited at the barrier; it has just left the
    # phase and joined the barrier, which is about to complete.
    waiting = [rank(r, last=NOW - 100, pending=(op(42, NOW - 100),)) for r in (1, 2, 3)]
    arriving = rank(0, last=NOW - 0.01, pending=(op(42, NOW - 0.01),))
    assert _decide(obs(*waiting, arriving)).verdict is None
    just_left = rank(0, last=NOW - 0.01, last_seq=41)  # phase ended, barrier not yet issued
    assert _decide(obs(*waiting, just_left)).verdict is None


def test_slow_first_step_is_not_a_hang() -> None:
    ranks = [
        rank(r, step=0, durations=(), last=NOW - 50, pending=(op(3, NOW - 50),)) for r in range(3)
    ]
    assert _decide(obs(*ranks)).verdict is None


def test_straggler_that_progresses_is_not_a_hang() -> None:
    # Steps take 2 s because rank 3 is slow; the others wait 1.5 s in each collective.
    ranks = [rank(r, durations=(2.0, 2.1, 1.9), pending=(op(9, NOW - 1.5),)) for r in range(3)]
    ranks.append(rank(3, durations=(2.0, 2.1, 1.9), last=NOW - 1.5, last_seq=8))
    assert _decide(obs(*ranks)).verdict is None


def test_no_collective_in_flight_is_no_progress() -> None:
    ranks = [rank(r, last=NOW - 30, last_seq=10) for r in range(2)]
    assert _decide(obs(*ranks)).verdict is None  # idle, but below the 60 s ceiling
    ranks = [rank(r, last=NOW - 61, last_seq=10) for r in range(2)]
    v = _decide(obs(*ranks)).verdict
    assert v is not None and v.kind == VerdictKind.NO_PROGRESS
    assert {s.rank for s in v.suspects} == {0, 1}


def test_mismatched_collective_is_named() -> None:
    ranks = [rank(r, last=NOW - 10, pending=(op(7, NOW - 10),)) for r in range(3)]
    ranks.append(rank(3, last=NOW - 10, pending=(op(7, NOW - 10, code=OpCode.BROADCAST),)))
    v = _decide(obs(*ranks)).verdict
    assert v is not None and v.culprit == 3 and v.suspects[0].kind == SuspectKind.MISMATCH


def test_member_on_another_node_is_a_remote_suspect() -> None:
    ranks = [rank(r, last=NOW - 10, pending=(op(5, NOW - 10),)) for r in range(2)]
    v = _decide(obs(*ranks, groups={"0": (0, 1, 2, 3)})).verdict
    assert v is not None and {s.rank for s in v.suspects} == {2, 3}
    assert all(s.kind == SuspectKind.REMOTE for s in v.suspects)


def test_device_not_started_is_suspect_on_cuda() -> None:
    ranks = [rank(r, last=NOW - 10, pending=(op(5, NOW - 10, OpState.STARTED),)) for r in (0, 1)]
    ranks.append(rank(2, last=NOW - 10, pending=(op(5, NOW - 10, OpState.ENQUEUED),)))
    v = _decide(obs(*ranks)).verdict
    assert v is not None and v.culprit == 2 and v.suspects[0].kind == SuspectKind.NOT_STARTED


def test_wait_chain_leads_to_the_idle_rank() -> None:
    groups = {"0": (0, 1), "1": (1, 2)}
    r0 = rank(0, last=NOW - 10, pending=(op(5, NOW - 10, group="0"),))
    r1 = rank(1, last=NOW - 10, pending=(op(3, NOW - 10, group="1"),))  # behind in group 0
    r2 = rank(2, last=NOW - 10, last_seq=2, group="1")
    s = find_suspects(obs(r0, r1, r2, groups=groups))
    assert [x.rank for x in s] == [2]


def test_after_a_recovery_in_place_no_rank_is_judged_on_the_time_before_it() -> None:
    # Rank 1 hung; the world recovered in place (same attempt). At the first check after it,
    # rank 1 already waits in the new world's first collective, while rank 0 is still tearing
    # its last generation down: silent since before the incident, but not for a limit since.
    hung = [
        rank(0, last=NOW - 10, pending=(op(42, NOW - 10),)),
        rank(1, last=NOW - 10, last_seq=41),
    ]
    first = _decide(obs(*hung), OnHang.RECOVER)
    assert first.verdict is not None
    back = obs(
        rank(0, last=NOW - 10, last_seq=42), rank(1, last=NOW, pending=(op(1, NOW, group="0@1"),))
    )
    resumed = _decide(back, OnHang.RECOVER, first.state)
    assert [e.kind for e in resumed.events] == [EventKind.RECOVERED] and resumed.verdict is None
    # The same silence, a ceiling (60 s) after the recovery: a hang again.
    later = replace(
        back,
        now=NOW + 61,
        ranks=tuple(replace(r, last_activity=r.last_activity) for r in back.ranks),
    )
    again = _decide(later, OnHang.RECOVER, resumed.state)
    assert again.verdict is not None and again.verdict.culprit == 0, again.verdict


def test_all_inside_the_same_collective_names_the_last_arrival_weakly() -> None:
    ranks = [rank(r, last=NOW - 10, pending=(op(5, NOW - 10 + 0.1 * r),)) for r in range(3)]
    v = _decide(obs(*ranks)).verdict
    assert v is not None and v.culprit == 2 and v.suspects[0].kind == SuspectKind.LAST_ARRIVAL


def test_one_incident_until_progress_resumes_then_a_new_attempt_resets() -> None:
    waiting = [rank(r, last=NOW - 10, pending=(op(42, NOW - 10),)) for r in (0, 1)]
    o = obs(*waiting, rank(2, last=NOW - 10, last_seq=41))
    first = _decide(o)
    assert first.verdict is not None
    again = _decide(o, state=first.state)
    assert again.verdict is None and again.actions == ()
    moved = obs(rank(0, last=NOW), rank(1, last=NOW), rank(2, last=NOW))
    resumed = _decide(moved, state=first.state)
    assert [e.kind for e in resumed.events] == [EventKind.RECOVERED]
    restarted = _decide(
        obs(*waiting, rank(2, last=NOW - 10, last_seq=41), attempt=1), state=first.state
    )
    assert restarted.verdict is not None
    assert EventKind.NEW_ATTEMPT in [e.kind for e in restarted.events]


def test_job_end_event_once() -> None:
    ended = obs(*(rank(r, liveness=Liveness.CLOSED) for r in range(2)))
    d = _decide(ended)
    assert d.verdict is None and [e.kind for e in d.events] == [EventKind.JOB_ENDED]
    assert _decide(ended, state=d.state).events == ()


def test_straggler_scores_name_the_rank_that_arrives_last() -> None:
    recent = {}
    for r in range(4):
        late = 0.4 if r == 2 else 0.0
        recent[r] = tuple(
            op(s, 1.0 * s + late + 0.001 * r, OpState.COMPLETED, t_end=1.0 * s + 0.5)
            for s in range(1, 11)
        )
    scores = straggler_scores(recent, min_ops=5)
    top = scores[0]
    assert top.rank == 2 and top.is_straggler and top.late_share == 1.0
    assert top.wait_caused == pytest.approx(0.4 - 0.001, abs=0.01)
    assert not any(s.is_straggler for s in scores[1:])
    balanced = {
        r: tuple(op(s, 10.0 * s + 0.001 * ((r + s) % 4), OpState.COMPLETED) for s in range(1, 11))
        for r in range(4)
    }
    assert not any(s.is_straggler for s in straggler_scores(balanced, min_ops=5))


def test_a_relaunch_recovers_once_the_dead_rank_is_out_of_view() -> None:
    dead = rank(1, liveness=Liveness.DIED, exited_at=NOW - 1)
    first = _decide(obs(rank(0, pending=(op(42, NOW - 0.5),)), dead))
    assert first.verdict is not None and first.verdict.kind == VerdictKind.RANK_EXITED
    still = _decide(obs(rank(0, last=NOW + 5), dead), state=first.state)
    assert still.events == ()  # the dead rank is still in view: the incident stays open
    relaunched = obs(rank(0, last=NOW + 70), rank(1, last=NOW + 70))
    d = _decide(relaunched, state=first.state)
    assert [e.kind for e in d.events] == [EventKind.RECOVERED] and d.state.incident is None


def test_a_rank_that_fails_after_the_incident_is_no_recovery() -> None:
    """Stopped ranks elsewhere break the collective: a rank fails with an exception (its
    journal's last record moves) while the other still runs. The incident stays open: no
    recovery, no second incident naming the failed rank."""
    waiting = [rank(r, last=NOW - 10, pending=(op(42, NOW - 10),)) for r in (0, 1)]
    first = _decide(obs(*waiting, rank(2, last=NOW - 10, last_seq=41)))
    assert first.verdict is not None
    failed = rank(0, liveness=Liveness.FAILED, last=NOW + 1, exited_at=NOW + 1)
    d = _decide(obs(failed, rank(1, last=NOW + 1), rank(2, last=NOW - 10)), state=first.state)
    assert d.verdict is None and d.events == () and d.state.incident == first.verdict


def test_every_wait_is_judged_before_torch_aborts_its_group() -> None:
    # Rank 0 is in a phase with a 600 s limit, which the waiters inherit; their group's
    # collective timeout is 300 s, so torch would abort first: act at 80% of it.
    waiting = [rank(r, last=NOW - 250, pending=(op(42, NOW - 250),)) for r in (1, 2)]
    evaluating = rank(0, last=NOW - 250, last_seq=41, phase="eval")
    o = Observation(
        now=NOW,
        ranks=(evaluating, *waiting),
        groups={"0": (0, 1, 2)},
        world_size=3,
        group_timeouts={"0": 300.0},
    )
    v = _decide(o).verdict
    assert v is not None and v.culprit == 0
    assert v.overdue[0].limit.seconds == pytest.approx(240.0)
    assert "collective timeout" in v.overdue[0].limit.basis


def test_a_rank_slow_before_each_step_is_a_straggler_though_rarely_last() -> None:
    # Six collectives per 0.5 s step. Rank 2 sleeps 0.3 s before each step, so it arrives last
    # only at the step's first collective; later ones arrive in an order that is noise.
    recent: dict[int, list[OpView]] = {r: [] for r in range(4)}
    seq = 0
    for step in range(20):
        base = step * 0.5
        for k in range(6):
            seq += 1
            for r in range(4):
                jitter = 0.001 * ((r * 7 + seq * 3) % 4)
                late = 0.3 if (r == 2 and k == 0) else 0.0
                t = base + 0.3 * (k > 0) + 0.02 * k + late + jitter
                recent[r].append(op(seq, t, OpState.COMPLETED))
    scores = {s.rank: s for s in straggler_scores({r: tuple(v) for r, v in recent.items()})}
    assert scores[2].late_share < 0.5 and scores[2].is_straggler
    assert [r for r, s in scores.items() if s.is_straggler] == [2]


def dev(seq: int, t: float, state: OpState = OpState.ENQUEUED) -> OpView:
    """An op tracked on the device (CUDA events)."""
    return replace(op(seq, t, state), on_device=True)


@pytest.mark.parametrize(
    "ranks, groups, culprit, kinds",
    [
        # one NCCL rank, its collective queued behind a kernel that never ends
        ([rank(0, last=NOW - 10, pending=(dev(9, NOW - 10),))], {"0": (0,)}, 0,
         {0: SuspectKind.NOT_STARTED}),
        # the same on gloo: nothing tracks the device, so nothing says it never started
        ([rank(0, last=NOW - 10, pending=(op(9, NOW - 10),))], {"0": (0,)}, 0,
         {0: SuspectKind.BEHIND_IDLE}),
        # started on the device: the collective itself is stuck, not the stream before it
        ([rank(0, last=NOW - 10, pending=(dev(9, NOW - 10, OpState.STARTED),))], {"0": (0,)}, 0,
         {0: SuspectKind.BEHIND_IDLE}),
        # both inside it, neither started: each waits on the other, this rule names no one
        ([rank(r, last=NOW - 10, pending=(dev(9, NOW - 10 + r),)) for r in (0, 1)], None, 1,
         {1: SuspectKind.LAST_ARRIVAL}),
        # the peer never joined: it is behind (named first); the rank's blocked stream too
        ([rank(0, last=NOW - 10, pending=(dev(9, NOW - 10),)),
          rank(1, last=NOW - 10, last_seq=8)], None, 1,
         {1: SuspectKind.BEHIND_IDLE, 0: SuspectKind.NOT_STARTED}),
    ],
)  # fmt: skip
def test_op_enqueued_on_the_device_and_never_started_names_its_rank(
    ranks: list[RankSnapshot], groups: dict | None, culprit: int, kinds: dict
) -> None:
    v = _decide(obs(*ranks, groups=groups)).verdict
    assert v is not None and v.culprit == culprit, v
    assert {s.rank: s.kind for s in v.suspects} == kinds
    for s in v.suspects:
        if s.kind == SuspectKind.NOT_STARTED:
            assert "enqueued on the device but never started" in s.reason
            assert "the stream is blocked by earlier work" in v.summary or s.rank != culprit
