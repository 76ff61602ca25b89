"""The claimant of a fallback, pure: when it concludes (`now` passed in), and what it counts as
the views holding every rank."""

from __future__ import annotations

from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.job.decisions import NodeReport, Where, parse_name
from diag.agent.job.fallback import QUIET, Progress, Step, Views, first_hand_in, step, wake_in
from diag.agent.job.nodeview import view_document
from diag.formats.records import OpCode, OpState

DEADLINE = 110.0  # the end of the claimant's settle time


def test_missing_views_wait_until_the_settle_time_runs_out() -> None:
    missing = Progress(first_hand=False, covered_at=None)
    for now in (100.0, 105.0, 109.99):
        assert step(missing, now, deadline=DEADLINE) == Step.WAIT
    assert step(missing, DEADLINE, deadline=DEADLINE) == Step.SETTLED
    # Its next look: its poll, or the end of the settle time if sooner.
    assert wake_in(missing, 100.0, deadline=DEADLINE, poll=0.5) == 0.5
    assert abs(wake_in(missing, 109.8, deadline=DEADLINE, poll=0.5) - 0.2) < 1e-9


def test_views_holding_every_rank_conclude_after_the_quiet_time_not_the_settle_time() -> None:
    covered = Progress(first_hand=False, covered_at=102.0)
    assert step(covered, 102.0, deadline=DEADLINE) == Step.WAIT  # it still looks for one
    assert step(covered, 102.0 + QUIET / 2, deadline=DEADLINE) == Step.WAIT
    assert step(covered, 102.0 + QUIET, deadline=DEADLINE) == Step.VIEWS
    assert abs(wake_in(covered, 102.1, deadline=DEADLINE, poll=5.0) - (QUIET - 0.1)) < 1e-9
    # Covered only at the end of the settle time: the quiet time still runs.
    late = Progress(first_hand=False, covered_at=DEADLINE - 0.1)
    assert step(late, DEADLINE - 0.05, deadline=DEADLINE) == Step.WAIT
    assert step(late, DEADLINE, deadline=DEADLINE) == Step.SETTLED


def test_a_first_hand_report_wins_while_views_are_missing() -> None:
    names = [
        parse_name(NodeReport(f"n{i}", None, Where.REMOTE, f"/t/e{i}").name()) for i in range(3)
    ]
    assert not first_hand_in([n for n in names if n])
    own = parse_name(NodeReport("n3", 7, Where.LOCAL, "/t/e3").name())
    assert own is not None and first_hand_in([*(n for n in names if n), own])
    p = Progress(first_hand=True, covered_at=None)
    assert step(p, 101.0, deadline=DEADLINE) == Step.FIRST_HAND  # well before the settle time


def test_a_node_changing_its_mind_after_the_views_came_wins() -> None:
    """Every node filed a view, then one reports its own rank after all (within the quiet time,
    or later, as long as the verdict is not in place): first-hand, not the views."""
    for at in (102.0 + QUIET / 2, 102.0 + 3 * QUIET, DEADLINE + 1):
        assert step(Progress(True, covered_at=102.0), at, deadline=DEADLINE) == Step.FIRST_HAND


def _view(node: int, world: int, culprit: int) -> dict:
    now = 100.0
    done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 64, now - 12, now - 11.9)
    stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, now - 10)
    ranks = tuple(
        RankSnapshot(
            rank=r, local_rank=r % 2, pid=100 + r, node=f"n{node}", liveness=Liveness.RUNNING,
            started_at=0.0, last_activity=now - 10, step=7,
            pending=() if r == culprit else (stuck,),
            last_ops={"0": done if r == culprit else stuck},
        )
        for r in (2 * node, 2 * node + 1)
    )  # fmt: skip
    obs = Observation(now=now, ranks=ranks, groups={"0": tuple(range(world))}, world_size=world)
    return view_document(obs, f"n{node}", 1000.0)


def _report(node: int, view: dict | None) -> NodeReport:
    return NodeReport(f"n{node}", None, Where.REMOTE, f"/t/e{node}", view=view, wall=1000.0)


def test_views_cover_once_they_hold_every_rank_of_the_job() -> None:
    got = Views()
    first, *rest = (_report(i, _view(i, 6, culprit=3)) for i in range(3))
    got.add({first.name(): first})
    assert not got.cover  # ranks 2-5 missing
    got.add({r.name(): r for r in rest})
    assert got.cover and got.ranks == set(range(6))
    names = [parse_name(r.name()) for r in got.reports.values()]
    rank, node, basis = got.pick([n for n in names if n is not None], 1000.0)
    assert (rank, node) == (3, "n1") and basis.startswith("from the views of 3 nodes")


def test_a_report_without_a_view_leaves_it_to_the_settle_time() -> None:
    got = Views()
    got.add({f"r{i}": _report(i, _view(i, 4, culprit=3)) for i in (0, 1)})
    assert got.cover
    got.add({"x": _report(9, None)})  # a node that could not take its view: its ranks unknown
    assert not got.cover
