"""The hang limit soon after a launch or a restart follows the job's steady pace.

Table tests on the pure core (plain numbers for time), then the same history written into a real
journal and read back by the real observer: what a restart, a slow first save and a rank waiting
in its own flash save leave behind must not lift the limit above the floor.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from diag.agent.detect.hang import Policy, WatchState, decide
from diag.agent.detect.observation import Liveness, Observation, OpView, Paced, RankSnapshot
from diag.agent.detect.overdue import overdue_ranks
from diag.agent.detect.timeouts import TimeoutPolicy, settled_at
from diag.agent.observe.observer import Observer
from diag.formats.journalmeta import GroupInfo, JournalMeta, journal_path, write_meta
from diag.formats.journalwriter import JournalWriter
from diag.formats.records import DType, OpCode, OpFlag, OpState, RecordKind

NOW = 1000.0
DEFAULTS = TimeoutPolicy()  # floor 10 s, factor 5, ceiling 300 s, 2 warm-up steps
STEP = 0.17


def barrier(seq: int, since: float, group: str = "0") -> OpView:
    return OpView(group, seq, OpCode.BARRIER, OpState.ENQUEUED, 0, since)


def steady(start: float, n: int = 16) -> tuple[Paced, ...]:
    return tuple(Paced(f"step {i}", start + i * STEP, STEP) for i in range(n))


def snap(
    r: int,
    *,
    step: int = 30,
    launch_steps: int | None = 30,
    ends: tuple[float, ...] = (NOW - 20.0, NOW - 19.8),
    pace: tuple[Paced, ...] = (),
    phase: str = "",
    pending: tuple[OpView, ...] = (),
    last: float = NOW - 11.0,
) -> RankSnapshot:
    return RankSnapshot(
        rank=r, local_rank=r, pid=100 + r, node="n", liveness=Liveness.RUNNING,
        started_at=NOW - 30.0, last_activity=last, step=step, phase=phase,
        phase_since=last if phase else None, pending=pending,
        last_ops={p.group: p for p in pending}, launch_steps=launch_steps,
        launch_step_ends=ends, pace=pace or steady(NOW - 19.0),
    )  # fmt: skip


def observe(*ranks: RankSnapshot, timeout: float = 60.0, remote=()) -> Observation:  # type: ignore[no-untyped-def]
    world = max(r.rank for r in (*ranks, *remote)) + 1
    return Observation(
        now=NOW, ranks=tuple(ranks), groups={"0": tuple(range(world))}, world_size=world,
        pg_timeout=timeout, group_timeouts={"0": timeout}, remote=tuple(remote),
    )  # fmt: skip


def test_a_rank_waiting_in_its_flash_save_for_a_rank_that_stopped_before_its_own_is_held_to_the_floor() -> (
    None
):
    # The verdict: rank 0 entered the flash save (a "checkpoint" phase) and waits in its
    # agreement; rank 1 stopped before its save, outside any collective. The waiter's own phase
    # limit (30 min) was capped at 80% of the 60 s collective timeout: found after 48 s.
    o = observe(
        snap(0, phase="checkpoint", pending=(barrier(140, NOW - 11.0),)),
        snap(1, last=NOW - 11.0),
    )
    d = decide(WatchState(), o, Policy(DEFAULTS))
    assert d.verdict is not None and d.verdict.culprit == 1
    (over,) = d.verdict.overdue
    assert over.rank == 0 and over.limit.seconds == DEFAULTS.floor
    assert over.limit.basis.startswith("floor ("), over.limit.basis
    assert "waiting in phase 'checkpoint'" in over.limit.basis


@pytest.mark.parametrize(
    "other, remote, found",
    [
        # The rank it waits for is in the phase too (a slow save): the phase's limit stands.
        (snap(1, phase="checkpoint"), False, False),
        # Both in the phase and in the collective: no one is behind, the phase's limit stands.
        (snap(1, phase="checkpoint", pending=(barrier(140, NOW - 11.0),)), False, False),
        # On another node, and outside any phase: known, so the floor applies.
        (snap(1), True, True),
    ],
)
def test_the_waiters_own_phase_covers_only_waits_for_ranks_in_a_phase(
    other: RankSnapshot, remote: bool, found: bool
) -> None:
    waiter = snap(0, phase="checkpoint", pending=(barrier(140, NOW - 11.0),))
    o = observe(waiter, other) if not remote else observe(waiter, remote=(other,))
    _, overdue = overdue_ranks(o, DEFAULTS)
    assert (0 in {x.rank for x in overdue}) is found, overdue


def test_a_member_nobody_here_knows_leaves_the_waiters_phase_limit() -> None:
    waiter = snap(0, phase="checkpoint", pending=(barrier(140, NOW - 11.0),))
    o = Observation(
        now=NOW, ranks=(waiter,), groups={"0": (0, 1)}, world_size=2, pg_timeout=60.0,
        group_timeouts={"0": 60.0},
    )  # fmt: skip
    _, overdue = overdue_ranks(o, DEFAULTS)
    assert overdue == ()


def test_waits_before_every_rank_warmed_up_are_start_up_skew() -> None:
    # Rank 0 waited 12 s for rank 1, which was still starting (its warm-up ended at NOW - 18):
    # start-up skew, not the pace. Counted, it would make the limit 60 s.
    skew = Paced("all_reduce #3 of group 0", NOW - 31.0, 12.0)
    r0 = snap(0, ends=(NOW - 32.0, NOW - 31.5), pace=(skew, *steady(NOW - 17.9)),
              pending=(barrier(140, NOW - 11.0),))  # fmt: skip
    r1 = snap(1, ends=(NOW - 18.5, NOW - 18.0))
    assert settled_at((r0, r1), DEFAULTS) == NOW - 18.0
    _, overdue = overdue_ranks(observe(r0, r1), DEFAULTS)
    (over,) = overdue
    assert over.limit.seconds == DEFAULTS.floor, over.limit
    assert "step" in over.limit.basis and "ago" in over.limit.basis
    # Still warming up: nothing is steady yet, and its own warm-up limit covers the waiters.
    late = snap(1, launch_steps=1, ends=(NOW - 18.5,))
    assert settled_at((r0, late), DEFAULTS) == float("inf")
    assert overdue_ranks(observe(r0, late), DEFAULTS)[1] == ()


def test_a_restarted_rank_warms_up_again_though_its_step_resumes_at_the_checkpoint() -> None:
    r = snap(0, step=26, launch_steps=1, ends=(NOW - 20.0,))
    limits, _ = overdue_ranks(observe(r), DEFAULTS)
    assert limits[0].seconds == DEFAULTS.warmup_timeout
    assert limits[0].basis == "warm-up (1 steps since this launch at step 25 < 2)"


# -- the same through a real journal and the real observer ----------------------------------------


@pytest.fixture
def journal(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = journal_path(tmp_path, "early", 0)
    w = JournalWriter(path, rank=0, world_size=1, local_rank=0, attempt=1)
    write_meta(
        path,
        JournalMeta(
            job="early", rank=0, world_size=1, local_rank=0, local_world_size=1,
            pid=os.getpid(), pid_start_time=psutil.Process().create_time(), node="n", attempt=1,
        ),
    )  # fmt: skip
    yield tmp_path, w
    w.close()


def _ns(t: float) -> int:
    return int(t * 1e9)


def _op(w: JournalWriter, seq: int, t0: float, t1: float | None) -> None:
    s = w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 0, -1, seq, 64, _ns(t0))
    if t1 is not None:
        w.update(s, OpState.COMPLETED, t_end_ns=_ns(t1))


def _limit_after(run_dir: Path, pending_since: float) -> tuple[float, str, float]:
    obs = Observer(run_dir, agent_pids=frozenset())  # the test process starts the ranks
    try:
        now = time.monotonic()
        limits, overdue = overdue_ranks(obs.observe(now), DEFAULTS)
        age = now - pending_since
        assert overdue and overdue[0].age == pytest.approx(age, abs=0.5)
        return limits[0].seconds, overdue[0].limit.basis, age
    finally:
        obs.close()


def test_a_slow_second_step_after_a_restart_does_not_lift_the_limit(journal) -> None:  # type: ignore[no-untyped-def]
    # Resumed at step 25: its steps count on from there, but its second step waited 12 s for a
    # peer's first save, as the first launch's did. Counted (step 26 >= 2), 5 x 12 s = 60 s.
    run_dir, w = journal
    base = time.monotonic() - 40.0
    w.step(26, _ns(base + 1.0))
    _op(w, 1, base + 1.1, base + 13.1)
    w.step(27, _ns(base + 13.2))
    t = base + 13.2
    for i in range(13):
        _op(w, 2 + i, t + 0.05, t + 0.06)
        t += STEP
        w.step(28 + i, _ns(t))
    _op(w, 20, t + 0.05, None)  # stuck
    seconds, basis, _ = _limit_after(run_dir, t + 0.05)
    assert seconds == DEFAULTS.floor, basis
    assert basis.startswith("floor (5 x slowest step/op since warm-up 0.17 s"), basis


def test_a_world_formed_again_in_place_is_a_new_launch_for_the_pace(journal) -> None:  # type: ignore[no-untyped-def]
    # A survivor of a recovery in place: 12 steps in world 0, then 30 s of recovery, and its
    # steps go on in world 1 from step 9 (the restored one). The first step's time since the
    # last world's last step, 30 s, counted, would give 5 x 30 s; and its first two steps
    # there (the engine rebuilt) are a warm-up, as a restarted launch's.
    run_dir, w = journal
    path = journal_path(run_dir, "early", 0)
    meta = JournalMeta(
        job="early", rank=0, world_size=1, local_rank=0, local_world_size=1, pid=os.getpid(),
        pid_start_time=psutil.Process().create_time(), node="n", attempt=1,
        groups=(GroupInfo(0, "0", (0,)), GroupInfo(1, "0@1", (0,))),
    )  # fmt: skip
    write_meta(path, meta)
    t = time.monotonic() - 60.0
    for i in range(12):
        _op(w, 1 + i, t + 0.05, t + 0.06)
        t += STEP
        w.step(1 + i, _ns(t))
    t += 30.0  # the fault, the verdict, the next world, the engine again, the restore
    s = w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 1, -1, 1, 64, _ns(t))
    w.update(s, OpState.COMPLETED, t_end_ns=_ns(t + 0.01))
    for i in range(12):
        s = w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 1, -1, 2 + i, 64,
                        _ns(t + 0.05))  # fmt: skip
        w.update(s, OpState.COMPLETED, t_end_ns=_ns(t + 0.06))
        t += STEP
        w.step(10 + i, _ns(t))
    w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 1, -1, 20, 64, _ns(t + 0.05))
    seconds, basis, _ = _limit_after(run_dir, t + 0.05)
    assert seconds == DEFAULTS.floor, basis
    assert basis.startswith("floor (5 x slowest step/op since warm-up 0.17 s"), basis


def test_time_in_a_phase_is_not_the_pace(journal) -> None:  # type: ignore[no-untyped-def]
    # A first save that allocates its memory: 12 s in the "checkpoint" phase of step 3. Its
    # phase has a limit of its own; as the pace, 5 x 12.2 s = 61 s.
    run_dir, w = journal
    base = time.monotonic() - 40.0
    w.step(1, _ns(base + 1.0))
    w.step(2, _ns(base + 1.2))
    w.append(RecordKind.PHASE_BEGIN, name="checkpoint", t_start_ns=_ns(base + 1.3))
    _op(w, 1, base + 1.31, base + 13.2)  # the save's agreement, waiting for the slow one
    w.append(RecordKind.PHASE_END, name="checkpoint", t_end_ns=_ns(base + 13.3))
    w.step(3, _ns(base + 13.4))
    t = base + 13.4
    for i in range(13):
        _op(w, 2 + i, t + 0.05, t + 0.06)
        t += STEP
        w.step(4 + i, _ns(t))
    _op(w, 20, t + 0.05, None)
    seconds, basis, _ = _limit_after(run_dir, t + 0.05)
    assert seconds == DEFAULTS.floor, basis


def test_an_agent_that_missed_the_launchs_first_steps_does_not_restart_the_warm_up(
    tmp_path: Path,
) -> None:
    # The ring wrapped before the agent first read it (an agent restarted mid-run): which step
    # began this launch is unknown, and the journal's step count stands.
    path = journal_path(tmp_path, "early", 0)
    w = JournalWriter(path, rank=0, world_size=1, local_rank=0, capacity=16)
    write_meta(
        path,
        JournalMeta(
            job="early", rank=0, world_size=1, local_rank=0, local_world_size=1,
            pid=os.getpid(), pid_start_time=psutil.Process().create_time(), node="n",
        ),
    )  # fmt: skip
    try:
        t = time.monotonic() - 30.0
        for i in range(40):
            t += STEP
            w.step(101 + i, _ns(t))
        obs = Observer(tmp_path, agent_pids=frozenset())  # the test process starts the ranks
        try:
            o = obs.observe(time.monotonic())
        finally:
            obs.close()
        (r,) = o.ranks
        assert (r.step, r.launch_steps) == (140, 140)
        limits, _ = overdue_ranks(o, DEFAULTS)
        assert limits[0].seconds == DEFAULTS.floor, limits
    finally:
        w.close()
