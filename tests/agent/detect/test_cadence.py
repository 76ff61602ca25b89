"""Table-driven tests of the warm-up of ranks that mark no steps (pure): when their op pace counts
as evidence of training, the limit that follows, and the warning said once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from diag.agent.detect.cadence import KEEP_S, Cadence, fold
from diag.agent.detect.hang import EventKind, Policy, VerdictKind, WatchState, decide
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.detect.timeouts import TimeoutPolicy, rank_limit
from diag.formats.records import OpCode, OpState

T = 30.0
POLICY = TimeoutPolicy(ceiling=300.0, floor=10.0, warmup_timeout=900.0, warmup_cadence=T)


def ops_every(interval: float, start: float, end: float, op_s: float = 0.01) -> list[float]:
    """Completion times of ops finishing every `interval` seconds in [start, end)."""
    out, t = [], start
    while t < end:
        out.append(t)
        t += interval
    return out


def replay(ends: list[float], until: float, poll: float = 0.5, seconds: float = T):
    """Folds completions as the observer does, one poll every `poll` seconds; returns the
    cadence and the first poll time at which it was steady (None if never)."""
    c, became, i = Cadence(), None, 0
    ends = sorted(ends)
    now = poll
    while now <= until:
        new = []
        while i < len(ends) and ends[i] <= now:
            new.append((ends[i] - 0.01, ends[i]))
            i += 1
        c = fold(c, new, now, seconds)
        if became is None and c.steady:
            became = now
        now += poll
    return c, became


@pytest.mark.parametrize(
    "name, ends, until, steady_between",
    [
        # A loop of 0.2 s iterations: steady once it has run for T seconds.
        ("steady loop", ops_every(0.2, 5.0, 200.0), 200.0, (35.0, 36.0)),
        # One iteration every 8 s: windows must hold two pauses each, so 6 x 8 = 48 s.
        ("slow iterations", ops_every(8.0, 0.0, 200.0), 200.0, (48.0, 57.0)),
        # Start-up: 20 broadcasts in 2 s, a 25 s pause (compilation), then 0.2 s iterations.
        # The pause makes the span 6 x 25 s, which holds the burst, the pause and the loop.
        (
            "burst, pause, loop",
            ops_every(0.1, 0.0, 2.0) + ops_every(0.2, 27.0, 400.0),
            400.0,
            (150.0, 160.0),
        ),
        # A ramp: 1 op/s for 20 s, then 20 ops/s: windows 20x apart are not steady, until the
        # slow part is mostly out of the span (the oldest window then holds 50 ops or more).
        ("ramp", ops_every(1.0, 0.0, 20.0) + ops_every(0.05, 20.0, 100.0), 100.0, (42.0, 43.0)),
        # Too slow to judge (6 x 60 s is beyond the kept history), and a burst that stops.
        ("one op a minute", ops_every(60.0, 0.0, 600.0), 600.0, None),
        ("a burst, then nothing", ops_every(0.1, 0.0, 10.0), 200.0, None),
    ],
)
def test_when_the_pace_counts_as_training(
    name: str, ends: list[float], until: float, steady_between: tuple[float, float] | None
) -> None:
    _, became = replay(ends, until)
    if steady_between is None:
        assert became is None, name
    else:
        assert became is not None and steady_between[0] <= became <= steady_between[1], (
            name,
            became,
        )


def test_zero_seconds_turns_the_evidence_off() -> None:
    assert replay(ops_every(0.2, 0.0, 200.0), 200.0, seconds=0.0)[1] is None


def test_once_steady_a_rank_stays_out_of_warm_up_and_its_typical_pause_holds() -> None:
    c, became = replay(ops_every(0.25, 0.0, 60.0), 60.0)
    assert became is not None and c.typical == pytest.approx(0.25, abs=0.02)
    # The rank hangs: nothing completes for minutes. Nothing to fold: it stays as it was.
    later = fold(c, [], 600.0, T)
    assert later.steady and later.typical == c.typical
    # It resumes 100 s after its last op: that pause is the new typical one.
    resumed = fold(later, [(159.9, 160.0)], 160.0, T)
    assert resumed.steady and resumed.typical == pytest.approx(160.0 - 59.75)
    # Buckets older than KEEP_S go: the typical pause is the newest one only.
    aged = fold(resumed, [(160.9 + KEEP_S, 161.0 + KEEP_S)], 161.0 + KEEP_S, T)
    assert aged.typical == pytest.approx(KEEP_S + 1.0)
    assert [b.second for b in aged.buckets] == [int(161 + KEEP_S)]


NOW = 1000.0


def rank(r: int, *, cadence: Cadence | None, step: int = 0, pending: bool = False) -> RankSnapshot:
    op = OpView("0", 50, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, NOW - 12)
    done = OpView("0", 49, OpCode.ALL_REDUCE, OpState.COMPLETED, 64, NOW - 12.2, NOW - 12.1)
    return RankSnapshot(
        rank=r, local_rank=r, pid=100 + r, node="n", liveness=Liveness.RUNNING, started_at=0.0,
        last_activity=NOW - 12, step=step, pending=(op,) if pending else (),
        last_ops={"0": op if pending else done}, cadence=cadence,
    )  # fmt: skip


STEADY = Cadence(steady_since=NOW - 60, steady_over=30.0, last_end=NOW - 12)


def steady(typical: float) -> Cadence:
    from diag.agent.detect.cadence import Bucket

    return replace(STEADY, buckets=(Bucket(int(NOW - 20), 10, typical, 0.01),))


@pytest.mark.parametrize(
    "snapshot, seconds, basis",
    [
        (rank(0, cadence=None), 900.0, "warm-up"),
        (rank(0, cadence=Cadence(last_end=NOW)), 900.0, "warm-up"),  # not steady yet
        (rank(0, cadence=steady(0.3)), 10.0, "floor (5 x longest pause between ops 0.3 s"),
        (rank(0, cadence=steady(4.0)), 20.0, "5 x longest pause between ops 4 s"),
        (rank(0, cadence=steady(100.0)), 300.0, "ceiling"),
        # A rank that marked one step keeps the step rule: the warm-up of its first steps.
        (rank(0, cadence=steady(0.3), step=1), 900.0, "warm-up (step 1 < 2)"),
    ],
)
def test_limit_of_a_rank_without_steps(snapshot: RankSnapshot, seconds: float, basis: str) -> None:
    limit = rank_limit(snapshot, POLICY)
    assert limit.seconds == pytest.approx(seconds)
    assert basis in limit.basis
    if seconds < 900:
        assert "no step marked" in limit.basis


def _obs(*ranks: RankSnapshot, attempt: int = 0) -> Observation:
    return Observation(
        now=NOW, ranks=ranks, groups={"0": tuple(r.rank for r in ranks)},
        world_size=len(ranks), attempt=attempt,
    )  # fmt: skip


def test_a_hang_without_steps_is_found_on_the_pace_limit_and_the_warning_is_said_once() -> None:
    policy = Policy(timeouts=POLICY)
    # Ranks 0 and 1 wait in #50 for 12 s; rank 2 never joined. Before the pace counts, the
    # 900 s warm-up limit holds and nothing is said.
    warming = [rank(r, cadence=Cadence(last_end=NOW - 12), pending=r < 2) for r in range(3)]
    d = decide(WatchState(), _obs(*warming), policy)
    assert d.verdict is None and d.events == ()
    # Once it counts: the limit is the floor (10 s), the hang is found, the warning said.
    ranks = [rank(r, cadence=steady(0.3), pending=r < 2) for r in range(3)]
    d = decide(d.state, _obs(*ranks), policy)
    kinds = [e.kind for e in d.events]
    assert kinds == [EventKind.NO_STEPS, EventKind.INCIDENT]
    warning = d.events[0].message
    assert "ranks 0,1,2 mark no training steps" in warning and "900 s warm-up" in warning
    assert "now 10.0 s" in warning
    v = d.verdict
    assert v is not None and v.kind == VerdictKind.HANG and v.culprit == 2
    assert "no step marked" in v.overdue[0].limit.basis
    # Said once: not again, incident open or not; again for a relaunch (a new attempt).
    again = decide(d.state, _obs(*ranks), policy)
    assert EventKind.NO_STEPS not in [e.kind for e in again.events]
    relaunch = decide(again.state, _obs(*ranks, attempt=1), policy)
    assert EventKind.NO_STEPS in [e.kind for e in relaunch.events]
