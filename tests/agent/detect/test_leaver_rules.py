"""Table tests of the pure rule for a rank that leaves before its peers (leaver.py, hang.py):
it is the cause of what follows, whether the peers then fail, hang or are killed, locally and in
the job verdict's analysis of every node's view."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_hang_rules import NOW, _decide, obs, op, rank

from diag.agent.detect.culprit import SuspectKind, find_suspects
from diag.agent.detect.hang import EventKind, VerdictKind
from diag.agent.detect.leaver import find_leavers
from diag.agent.detect.observation import Liveness, Observation, OpView
from diag.agent.job.assembly import pick_culprit
from diag.agent.job.decisions import NodeReport, Where, parse_name
from diag.agent.job.link import mine_of
from diag.agent.job.nodeview import analyse, view_document
from diag.formats.records import OpCode, OpState

CLOSED = Liveness.CLOSED


def left(r: int, *, seq: int = 20, exited: float | None = NOW - 3.0, step: int = 20):
    return rank(r, last=NOW - 3.2, last_seq=seq, liveness=CLOSED, exited_at=exited, step=step)


def failed(r: int, seq: int = 21):
    return replace(
        rank(r, last=NOW - 2.0, liveness=Liveness.FAILED, exited_at=NOW - 1.0),
        last_ops={"0": op(seq, NOW - 2.5, OpState.FAILED, t_end=NOW - 2.0)},
    )


@pytest.mark.parametrize(
    "case, others",
    [
        # gloo: the connection closes and the peers fail, the first of them before the others
        ("peers fail", lambda: [failed(0), failed(2), failed(3)]),
        # NCCL: the peers wait in the next all-reduce for ever
        ("peers hang", lambda: [rank(r, last=NOW - 2.5, pending=(op(21, NOW - 2.5),)) for r in (0, 2, 3)]),
        # the launcher kills the peers, stuck in the all-reduce, after the first failure
        ("peers killed", lambda: [
            replace(rank(r, pending=(op(21, NOW - 2.5),)), liveness=Liveness.DIED, exited_at=NOW - 0.5)
            for r in (0, 2, 3)
        ]),
    ],
)  # fmt: skip
def test_the_rank_that_left_first_is_named_however_the_peers_end(case: str, others) -> None:
    v = _decide(obs(left(1), *others())).verdict
    assert v is not None and v.kind == VerdictKind.RANK_EXITED, case
    assert v.culprit == 1, v.summary
    assert v.suspects[0].kind == SuspectKind.LEFT
    assert v.summary.startswith(
        "rank 1 ended cleanly (its journal closed at exit, no uncaught exception) after step 20 (its last op: "
        "all_reduce #20 of group 0) while ranks 0,2,3 went on to all_reduce #21 of group 0: its "
        "data may have run out before theirs"
    ), v.summary
    assert v.expired_at == pytest.approx(NOW - 3.0)  # it leads a cascade by when it left


def test_a_rank_that_left_the_group_and_runs_on_is_named() -> None:
    gone = replace(left(1, exited=None), left_group=True)
    o = obs(gone, *(rank(r, pending=(op(21, NOW - 1),)) for r in (0, 2)))
    v = _decide(o).verdict
    assert v is not None and v.culprit == 1
    assert v.summary.startswith(
        "rank 1 left the process group (destroy_process_group) and runs on alone after step 20"
    ), v.summary


def test_a_job_that_ends_normally_on_every_rank_is_no_incident() -> None:
    # Every rank reached the same last op; some closed, some still finishing it.
    o = obs(left(0), left(1), rank(2, pending=(op(20, NOW - 0.1),)), left(3, exited=None))
    d = _decide(o)
    assert d.verdict is None and find_leavers(o) == []
    d = _decide(obs(*(left(r) for r in range(4))))
    assert d.verdict is None
    assert [e.kind for e in d.events] == [EventKind.JOB_ENDED]


def test_a_world_formed_again_in_place_settles_the_last_worlds_ops() -> None:
    # Generation 0's all-reduce #21 failed on rank 0 when the world was aborted (recovery in
    # place); both ranks then trained in generation 1 ("0@1") and ended at the same op there.
    def ended(r: int, gen0: OpView) -> object:
        return replace(
            left(r),
            last_ops={"0": gen0, "0@1": op(9, NOW - 3.3, OpState.COMPLETED)},
        )

    o = obs(
        ended(0, op(21, NOW - 8, OpState.FAILED, t_end=NOW - 6)),
        ended(1, op(20, NOW - 9, OpState.COMPLETED)),
        groups={"0": (0, 1), "0@1": (0, 1)},
    )
    assert find_leavers(o) == []
    assert _decide(o).verdict is None
    # Without the world mark, the same ops are a leaver: rank 1 never reached #21.
    o = obs(
        ended(0, op(21, NOW - 8, OpState.FAILED, t_end=NOW - 6)),
        replace(left(1), last_ops={"0": op(20, NOW - 9, OpState.COMPLETED)}),
    )
    assert [lv.rank.rank for lv in find_leavers(o)] == [1]


def test_ops_on_a_group_it_is_not_in_do_not_need_it() -> None:
    sub = op(5, NOW - 1, group="sub")
    o = obs(
        left(1),
        *(replace(rank(r, last_seq=20), pending=(sub,), last_ops={"0": op(20, NOW - 4, OpState.COMPLETED), "sub": sub}) for r in (0, 2)),
        groups={"0": (0, 1, 2), "sub": (0, 2)},
    )  # fmt: skip
    assert find_leavers(o) == []


def test_a_receive_from_the_rank_that_left_names_it() -> None:
    recv = OpView("0", 7, OpCode.RECV, OpState.ENQUEUED, 64, NOW - 1, peer=1)
    sent = OpView("0", 6, OpCode.SEND, OpState.COMPLETED, 64, NOW - 4, NOW - 3.9, peer=0)
    gone = replace(left(1), p2p={("0", 0): (sent,)})
    o = obs(gone, replace(rank(0, last_seq=20), pending=(recv,)))
    v = _decide(o).verdict
    assert v is not None and v.culprit == 1 and "recv #7 of group 0 from rank 1" in v.summary


def test_the_incident_holds_while_the_rank_that_left_is_needed() -> None:
    waiting = [rank(r, last=NOW - 2.5, pending=(op(21, NOW - 2.5),)) for r in (0, 2)]
    d = _decide(obs(left(1), *waiting))
    assert d.verdict is not None
    later = obs(left(1), *(replace(w, last_activity=NOW) for w in waiting))
    d2 = _decide(later, state=d.state)
    assert d2.verdict is None and EventKind.RECOVERED not in [e.kind for e in d2.events]


def test_the_job_verdict_names_the_rank_that_left_from_the_nodes_views() -> None:
    # Rank 1 on node a left; ranks 2, 3 on node b wait in #21 (node a has no other rank).
    a = Observation(now=NOW, ranks=(replace(left(1), node="a"),), groups={"0": (0, 1, 2, 3)},
                    world_size=4, job="j")  # fmt: skip
    b_ranks = tuple(
        replace(rank(r, last=NOW - 2.5, pending=(op(21, NOW - 2.5),)), node="b") for r in (0, 2, 3)
    )
    b = Observation(now=NOW, ranks=b_ranks, groups={"0": (0, 1, 2, 3)}, world_size=4, job="j")
    views = [view_document(a, "a", 5000.0), view_document(b, "b", 5000.0)]
    got = analyse(views, 5000.0)
    assert (got.culprit, got.node) == (1, "a"), got.reason
    assert "ended cleanly" in got.reason and "went on to all_reduce #21" in got.reason
    # Node b alone, with node a's view among its remote ranks, names it too.
    remote = replace(b, remote=(replace(left(1), node="a"),))
    lead = find_suspects(remote)[0]
    assert lead.rank == 1 and lead.kind == SuspectKind.LEFT and "on node a" in lead.reason


def test_many_closed_ranks_stay_linear() -> None:
    # 4,096 ranks that all ended at the same op: no leaver, and no quadratic scan.
    ranks = [left(r) for r in range(4096)]
    o = Observation(now=NOW, ranks=tuple(ranks), groups={"0": tuple(range(4096))}, world_size=4096)
    assert find_leavers(o) == []


def test_across_nodes_the_rank_that_left_leads_the_peers_that_failed_after_it() -> None:
    """Node a saw its rank 1 leave (first-hand, at its end); node b saw its ranks fail in the
    all-reduce after it (first-hand deaths, later). Both file under the attempt's one death id;
    the job verdict takes the earliest first sign: rank 1."""
    a = obs(replace(left(1), node="a"), replace(rank(0, pending=(op(21, NOW - 2.5),)), node="a"))
    b = Observation(now=NOW, ranks=(replace(failed(2), node="b"), replace(failed(3), node="b")),
                    groups={"0": (0, 1, 2, 3)}, world_size=4)  # fmt: skip
    va, vb = _decide(a).verdict, _decide(b).verdict
    assert va is not None and vb is not None and va.incident_id == vb.incident_id
    ma, mb = mine_of(va, a, 5000.0), mine_of(vb, b, 5000.0)
    assert (ma.where, mb.where) == (Where.LOCAL, Where.LOCAL)
    reports = {
        f"r{v.culprit}.L.{n}~e{n}": NodeReport(n, v.culprit, Where.LOCAL, f"/t/e{n}",
                                               first_sign_wall=m.first_sign_wall)
        for n, v, m in (("b", vb, mb), ("a", va, ma))
    }  # fmt: skip
    names = [parse_name(f) for f in reports]
    rank_, node, basis = pick_culprit([n for n in names if n is not None], reports)
    assert (rank_, node) == (1, "a"), basis
