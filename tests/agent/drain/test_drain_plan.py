"""Table tests of the agent's drain decisions (diag/agent/drain/plan.py): plain numbers for time."""

from __future__ import annotations

import pytest

from diag.agent.drain.plan import (
    ActionKind,
    DrainSettings,
    JobView,
    Phase,
    RankView,
    decide,
    persist_budget,
    rank_settled,
    start,
    tighten,
)

S = DrainSettings(grace=30.0, margin=3.0)


def running(rank: int, **kw) -> RankView:  # type: ignore[no-untyped-def]
    return RankView(rank, alive=True, connected=True, **kw)


def gone(rank: int) -> RankView:
    return RankView(rank, alive=False, connected=False)


def kinds(decision) -> list[tuple[ActionKind, str, tuple[int, ...]]]:  # type: ignore[no-untyped-def]
    return [(a.kind, a.job, a.ranks) for a in decision.actions]


def test_deadlines_from_grace_margin_and_persist_budget() -> None:
    st = start("SIGTERM", 100.0, S, persist_bytes=0)
    assert st.deadline == 127.0
    assert st.rank_deadline == 122.0  # the 5 s minimum persist budget
    # 1 GB at a measured 200 MB/s: 7.5 s kept for the persist (1.5x safety).
    st = start("SIGTERM", 100.0, S, persist_bytes=10**9, persist_rate=200e6)
    assert st.rank_deadline == pytest.approx(127.0 - 7.5)
    # An early notice's reclaim time overrides the grace period.
    st = start("notice", 100.0, S, deadline=220.0)
    assert (st.deadline, st.rank_deadline) == (220.0, 215.0)


@pytest.mark.parametrize(
    ("nbytes", "rate", "window", "budget"),
    [
        (0, None, 27.0, 5.0),
        (10**9, None, 27.0, 13.5),  # assumed 100 MB/s -> 15 s, capped at half the window
        (10**9, 1e9, 27.0, 5.0),
        (4 * 10**8, 1e8, 27.0, 6.0),
        (0, None, 1.0, 0.5),
    ],
)
def test_persist_budget(nbytes: int, rate: float | None, window: float, budget: float) -> None:
    assert persist_budget(nbytes, rate, window) == pytest.approx(budget)


def test_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="shorter than the termination grace"):
        DrainSettings(grace=5.0, margin=5.0)
    with pytest.raises(ValueError, match="must be positive"):
        DrainSettings(grace=0.0)


@pytest.mark.parametrize(
    ("rank", "settled"),
    [
        (gone(0), True),
        (running(0), False),
        (running(0, reported_step=5), False),  # saved, not on storage yet
        (running(0, reported_step=5, persisted_step=4), False),
        (running(0, reported_step=5, persisted_step=5), True),  # exit_on_command=False
    ],
)
def test_rank_settled(rank: RankView, settled: bool) -> None:
    assert rank_settled(rank) is settled


def test_classic_sidecar_ranks_save_and_leave() -> None:
    st = start("SIGTERM", 0.0, S)
    d = decide(st, (JobView("j", (running(0), running(1))),), 0.0)
    assert kinds(d) == [(ActionKind.SEND_EXIT, "j", (0, 1))]
    assert d.state.phase == Phase.WAITING
    # Nothing is sent twice; the ranks are still on their way to a boundary.
    d = decide(d.state, (JobView("j", (running(0), running(1)), committed=10),), 1.0)
    assert kinds(d) == [] and d.state.phase == Phase.WAITING
    # They saved step 12 and asked for its persist: it is in flight, one rank left already.
    job = JobView("j", (gone(0), running(1, reported_step=12)), in_flight=1, committed=10)
    d = decide(d.state, (job,), 1.5)
    assert kinds(d) == [] and d.state.phase == Phase.WAITING
    job = JobView("j", (gone(0), gone(1)), in_flight=1, committed=10)
    d = decide(d.state, (job,), 2.0)
    assert kinds(d) == [] and d.state.phase == Phase.FINISHING
    d = decide(d.state, (JobView("j", (gone(0), gone(1)), committed=12),), 2.5)
    assert d.state.phase == Phase.DONE
    assert d.state.outcome == "done in 2.5 s; committed: j step 12"


def test_ranks_killed_by_sigterm_leave_snapshots_to_persist() -> None:
    # No signal handler in the trainer: SIGTERM killed the ranks; step 7 is complete in memory.
    st = start("SIGTERM", 0.0, S)
    job = JobView("j", (gone(0), gone(1)), newest_unpersisted=7, committed=5)
    d = decide(st, (job,), 0.1)
    assert kinds(d) == [(ActionKind.PERSIST, "j", ())]
    assert d.state.phase == Phase.FINISHING
    # The persist wrote and committed it.
    d = decide(d.state, (JobView("j", (gone(0), gone(1)), committed=7),), 0.5)
    assert d.state.phase == Phase.DONE


def test_native_sidecar_nothing_running_persists_at_once() -> None:
    # The trainer container exited before the agent's SIGTERM: no rank to wait for. The ranks'
    # own persist requests finish first (they may commit the newest step)...
    st = start("SIGTERM", 0.0, S)
    job = JobView("j", (), in_flight=2, newest_unpersisted=9, committed=8)
    d = decide(st, (job,), 0.0)
    assert kinds(d) == [] and d.state.phase == Phase.FINISHING
    # ... then what is still newer than storage (a rank SIGTERM killed left step 9).
    d = decide(d.state, (JobView("j", (), newest_unpersisted=9, committed=8),), 0.2)
    assert kinds(d) == [(ActionKind.PERSIST, "j", ())]
    d = decide(d.state, (JobView("j", (), committed=9),), 0.4)
    assert d.state.phase == Phase.DONE


def test_no_job_at_all_is_done_at_once() -> None:
    d = decide(start("SIGTERM", 0.0, S), (), 0.0)
    assert d.state.phase == Phase.DONE and d.state.outcome == "done in 0.0 s"


def test_long_step_persist_newest_then_stop() -> None:
    st = start("SIGTERM", 0.0, S)  # rank deadline 22, deadline 27
    job = JobView("j", (running(0), running(1)), newest_unpersisted=19, committed=10)
    d = decide(st, (job,), 0.0)
    # EXIT, and the step every rank completed (19, in memory) to storage while they finish.
    assert kinds(d) == [(ActionKind.SEND_EXIT, "j", (0, 1)), (ActionKind.PERSIST, "j", ())]
    job = JobView("j", (running(0), running(1)), committed=19)
    d = decide(d.state, (job,), 21.9)
    assert kinds(d) == [] and d.state.phase == Phase.WAITING
    d = decide(d.state, (job,), 22.0)
    assert kinds(d) == [(ActionKind.STOP_RANKS, "j", (0, 1))]
    assert any("reached no step boundary" in e.message for e in d.events)
    # Persisted; waiting for the stopped ranks to be gone.
    job = JobView("j", (running(0), gone(1)), committed=19)
    d = decide(d.state, (job,), 22.5)
    assert kinds(d) == [] and d.state.phase == Phase.FINISHING
    d = decide(d.state, (JobView("j", (gone(0), gone(1)), committed=19),), 23.0)
    assert d.state.phase == Phase.DONE


def test_deadline_gives_up_and_says_what_is_left() -> None:
    st = start("SIGTERM", 0.0, S)
    job = JobView("j", (running(0),), in_flight=1, newest_unpersisted=20, committed=10)
    d = decide(st, (job,), 27.0)
    assert d.state.phase == Phase.DONE and kinds(d) == []
    assert d.state.outcome.startswith("deadline reached: ")
    assert "j ranks 0 still running" in d.state.outcome
    assert "1 persist(s) unfinished" in d.state.outcome
    assert d.events[0].warning


def test_a_newer_snapshot_after_the_persist_is_persisted_too() -> None:
    st = start("SIGTERM", 0.0, S)
    d = decide(st, (JobView("j", (gone(0),), newest_unpersisted=7),), 0.0)
    assert kinds(d) == [(ActionKind.PERSIST, "j", ())]
    # Another local rank's death left step 8 complete meanwhile.
    d = decide(d.state, (JobView("j", (gone(0),), newest_unpersisted=8),), 0.1)
    assert kinds(d) == [(ActionKind.PERSIST, "j", ())]
    # A persist that failed is not retried in a loop: the drain ends with it reported.
    d = decide(d.state, (JobView("j", (gone(0),), newest_unpersisted=8),), 0.2)
    assert kinds(d) == [] and d.state.phase == Phase.DONE


def test_rank_that_connects_during_the_drain_gets_exit_too() -> None:
    st = start("SIGTERM", 0.0, S)
    d = decide(st, (JobView("a", (running(0),)),), 0.0)
    jobs = (JobView("a", (running(0),)), JobView("b", (running(3),)))
    d = decide(d.state, jobs, 0.5)
    assert kinds(d) == [(ActionKind.SEND_EXIT, "b", (3,))]
    # A rank that is not connected cannot be told; it is waited for until it leaves.
    d = decide(d.state, (JobView("c", (RankView(1, alive=True, connected=False),)),), 0.6)
    assert kinds(d) == [] and d.state.phase == Phase.WAITING


def test_ranks_stuck_with_nothing_persisted_yet_get_it_persisted_at_the_rank_deadline() -> None:
    st = start("SIGTERM", 0.0, S)
    d = decide(st, (JobView("j", (running(0),)),), 0.0)  # nothing complete in memory yet
    assert kinds(d) == [(ActionKind.SEND_EXIT, "j", (0,))]
    # A snapshot completed meanwhile (the rank's copy of its last save finished).
    job = JobView("j", (running(0),), newest_unpersisted=3)
    d = decide(d.state, (job,), 1.0)
    assert kinds(d) == [(ActionKind.PERSIST, "j", ())]
    d = decide(d.state, (JobView("j", (running(0),), newest_unpersisted=4),), 22.0)
    assert kinds(d) == [(ActionKind.PERSIST, "j", ()), (ActionKind.STOP_RANKS, "j", (0,))]


def test_waits_for_the_ranks_persist_requests_before_persisting_more() -> None:
    st = start("SIGTERM", 0.0, S)
    d = decide(st, (JobView("j", (running(0), running(1)), committed=4),), 0.0)
    # Both saved step 6 and left; their persist requests run; an older snapshot (5) is not
    # written meanwhile: the requests may commit 6.
    job = JobView("j", (gone(0), gone(1)), in_flight=2, newest_unpersisted=6, committed=4)
    d = decide(d.state, (job,), 3.0)
    assert kinds(d) == [] and d.state.phase == Phase.FINISHING
    d = decide(d.state, (JobView("j", (gone(0), gone(1)), committed=6),), 4.0)
    assert d.state.phase == Phase.DONE


def test_the_agents_exit_command_asks_for_the_trainers_drain_exit_code() -> None:
    from diag.formats import exitcodes
    from diag.trainer.graceful.stopflag import DRAIN_EXIT_CODE

    assert exitcodes.RANK_DRAINED == DRAIN_EXIT_CODE == 143


def test_sigterm_during_an_early_notice_brings_the_deadlines_forward() -> None:
    # An AWS notice at t=100 gives the reclaim at t=220; the kubelet's SIGTERM comes at t=150 and
    # its SIGKILL 30 s later, whatever the notice said.
    st = start("aws notice", 100.0, S, deadline=217.0)
    assert (st.deadline, st.rank_deadline) == (217.0, 212.0)
    tight = tighten(st, "SIGTERM", 150.0, S)
    assert (tight.deadline, tight.rank_deadline) == (177.0, 172.0)
    assert tight.reason == "aws notice, then SIGTERM"
    # A step that never ends: at the new rank deadline the ranks are stopped, not at 212.
    job = JobView("j", (running(0), running(1)), newest_unpersisted=7)
    d = decide(tight, (job,), 172.5)
    assert (ActionKind.STOP_RANKS, "j", (0, 1)) in kinds(d)
    assert not any(a.kind == ActionKind.STOP_RANKS for a in decide(st, (job,), 172.5).actions)
    # A later request that would end later changes nothing.
    assert tighten(tight, "SIGTERM", 160.0, S) is tight
    assert tighten(tight, "notice", 151.0, S, deadline=400.0) is tight
