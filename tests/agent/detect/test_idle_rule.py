"""The idle rule: a wait on a local rank that sits idle outside any collective (no CPU, no I/O)
is held to `idle_factor` x the pace rather than `factor` x it, and backs off when it recurs.

Table tests on the pure core; `tests/agent/observe/test_procs.py` shows that a real sleeping
process is seen idle and a spinning one is not, and the launch tests run it on a real hung rank.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import pytest

from diag.agent.config import agentconfig
from diag.agent.detect.hang import Policy, VerdictKind, WatchState, decide
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.detect.overdue import IDLE_BACKOFF_S, overdue_ranks
from diag.agent.detect.timeouts import TimeoutPolicy
from diag.formats.exitcodes import UsageError
from diag.formats.records import OpCode, OpState

NOW = 1000.0
STEP = 2.0  # the slowest step: usual limit 5 x 2 = 10 s, idle limit 2 x 2 = 4 s
TIMEOUTS = TimeoutPolicy(ceiling=60.0, floor=2.0, factor=5.0, idle_factor=2.0, warmup_steps=2)


def _op(seq: int, t: float) -> OpView:
    return OpView("0", seq, OpCode.ALL_REDUCE, OpState.ENQUEUED, 1024, t)


def waiter(r: int, since: float, *, step: int = 10, phase: str = "") -> RankSnapshot:
    return RankSnapshot(
        rank=r, local_rank=r, pid=100 + r, node="n", liveness=Liveness.RUNNING, started_at=0.0,
        last_activity=since, step=step, phase=phase, pending=(_op(42, since),),
        step_durations=(STEP,), proc_state="S",
    )  # fmt: skip


def behind(
    r: int,
    last: float,
    idle_since: float | None,
    *,
    step: int = 10,
    phase: str = "",
    liveness: Liveness = Liveness.RUNNING,
) -> RankSnapshot:
    done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 1024, last - 0.1, last)
    return RankSnapshot(
        rank=r, local_rank=r, pid=100 + r, node="n", liveness=liveness, started_at=0.0,
        last_activity=last, step=step, phase=phase, last_ops={"0": done},
        step_durations=(STEP,), proc_state="S", cpu_busy=0.0 if idle_since else 1.0,
        idle_since=idle_since,
    )  # fmt: skip


def obs(*ranks: RankSnapshot, now: float = NOW, members: tuple[int, ...] = (0, 1)) -> Observation:
    return Observation(now=now, ranks=ranks, groups={"0": members}, world_size=len(members))


def _overdue(o: Observation, timeouts: TimeoutPolicy = TIMEOUTS):
    return overdue_ranks(o, timeouts)[1]


def test_a_wait_on_an_idle_rank_is_a_hang_at_the_smaller_factor() -> None:
    o = obs(waiter(0, NOW - 5), behind(1, NOW - 5.1, NOW - 5))
    (late,) = _overdue(o)
    assert late.rank == 0 and late.idle == (1,)
    assert late.limit.seconds == pytest.approx(4.0)
    assert "2 x slowest" in late.limit.basis and "rank 1 idle (no CPU, no I/O)" in late.limit.basis
    v = decide(WatchState(), o, Policy(timeouts=TIMEOUTS)).verdict
    assert v is not None and v.kind == VerdictKind.HANG and v.culprit == 1
    assert v.expired_at == pytest.approx(NOW - 1.0)


@pytest.mark.parametrize(
    "case, behind_rank",
    [
        ("busy on CPU: it computes, a slow step", behind(1, NOW - 5.1, None)),
        ("idle only since 3 s: it computed until then", behind(1, NOW - 5.1, NOW - 3)),
        ("in a declared phase", behind(1, NOW - 5.1, NOW - 5, phase="eval")),
        ("still warming up: the warm-up limit", behind(1, NOW - 5.1, NOW - 5, step=1)),
    ],
)
def test_no_quicker_verdict_when_the_rank_behind_is_not_idle_stuck(
    case: str, behind_rank: RankSnapshot
) -> None:
    assert _overdue(obs(waiter(0, NOW - 5), behind_rank)) == (), case


def test_every_local_rank_behind_must_be_idle() -> None:
    o = obs(
        waiter(0, NOW - 5),
        behind(1, NOW - 5.1, NOW - 5),
        behind(2, NOW - 5.1, None),  # computes: the wait may be its slow step
        members=(0, 1, 2),
    )
    assert _overdue(o) == ()
    both = replace(o, ranks=(*o.ranks[:2], behind(2, NOW - 5.1, NOW - 4.9)))
    (late,) = _overdue(both)
    assert late.idle == (1, 2) and "ranks 1, 2 idle" in late.limit.basis


def test_a_wait_only_on_other_nodes_keeps_the_usual_limit() -> None:
    # This agent cannot see whether ranks 2, 3 idle: their own agents judge them.
    o = obs(waiter(0, NOW - 5), waiter(1, NOW - 5), members=(0, 1, 2, 3))
    assert _overdue(o) == ()
    assert len(_overdue(replace(o, now=NOW + 5.5))) == 2  # 10.5 s > 5 x 2 s


def test_the_rule_is_off_at_factor_zero() -> None:
    o = obs(waiter(0, NOW - 5), behind(1, NOW - 5.1, NOW - 5))
    assert _overdue(o, replace(TIMEOUTS, idle_factor=0.0)) == ()


def test_a_recurring_idle_verdict_backs_off_and_the_back_off_outlives_a_restart() -> None:
    policy = Policy(timeouts=TIMEOUTS)
    first = decide(WatchState(), obs(waiter(0, NOW - 5), behind(1, NOW - 5.1, NOW - 5)), policy)
    assert first.verdict is not None and first.state.idle_verdicts == (NOW,)
    # The ranks restart (a new attempt) and the same rank idles again: the factor is now 4.
    later = NOW + 60
    again = replace(
        obs(waiter(0, later - 5), behind(1, later - 5.1, later - 5), now=later), attempt=1
    )
    d = decide(first.state, again, policy)
    assert d.verdict is None and d.state.idle_verdicts == (NOW,)
    d = decide(d.state, replace(again, now=later + 3.5), policy)  # 8.5 s > 4 x 2 s
    assert d.verdict is not None and d.verdict.overdue[0].limit.seconds == pytest.approx(8.0)
    assert d.state.idle_verdicts == (NOW, later + 3.5)
    # Past the window the back-off is forgotten.
    late = NOW + IDLE_BACKOFF_S + 120
    fresh = replace(obs(waiter(0, late - 5), behind(1, late - 5.1, late - 5), now=late), attempt=2)
    d = decide(replace(d.state, idle_verdicts=(NOW,)), fresh, policy)
    assert d.verdict is not None and d.verdict.overdue[0].limit.seconds == pytest.approx(4.0)


def test_an_idle_factor_below_one_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=re.escape("--idle-factor must be 0 (off) or >= 1, got 0.5")
    ):
        TimeoutPolicy(idle_factor=0.5)
    parser = argparse.ArgumentParser()
    agentconfig.add_arguments(parser)
    env = {"DIAG_RUN_DIR": "/nonexistent/run"}
    with pytest.raises(UsageError, match="idle-factor"):
        agentconfig.load(parser.parse_args(["--idle-factor", "0.5"]), env)
    off = agentconfig.load(parser.parse_args(["--idle-factor", "0"]), env)
    assert off.policy.timeouts.idle_factor == 0.0
    assert agentconfig.load(parser.parse_args([]), env).policy.timeouts.idle_factor == 2.0
