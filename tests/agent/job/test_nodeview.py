"""A node's view of its ranks at an incident: what one agent writes into its report, another reads
on its own clock, and the analysis over every node's view that names a rank no single node can."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from diag.agent.detect.culprit import SuspectKind, find_suspects
from diag.agent.detect.hang import Policy, WatchState, decide
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.detect.timeouts import TimeoutPolicy
from diag.agent.job.nodeview import (
    analyse,
    fold_rank_lists,
    groups_from,
    snapshots_from,
    view_document,
)
from diag.agent.job.verdict import JobVerdictStore, NodeReport, Where
from diag.formats.records import OpCode, OpState


def _rank(r: int, node: str, now: float, *, pending: bool, last: float) -> RankSnapshot:
    done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 64, now - 12, now - 11.9)
    stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, now - 10)
    return RankSnapshot(
        rank=r, local_rank=r % 2, pid=100 + r, node=node, liveness=Liveness.RUNNING,
        started_at=0.0, last_activity=now - last, step=7, pending=(stuck,) if pending else (),
        last_ops={"0": stuck if pending else done}, step_durations=(0.5,), cpu_busy=0.0,
    )  # fmt: skip


def _obs(now: float, ranks: tuple[RankSnapshot, ...], world: int = 4) -> Observation:
    return Observation(
        now=now, ranks=ranks, groups={"0": tuple(range(world))}, world_size=world, job="j"
    )


def _node_a(now: float) -> Observation:
    return _obs(now, (_rank(0, "node-a", now, pending=True, last=10),
                      _rank(1, "node-a", now, pending=True, last=10)))  # fmt: skip


def _node_b(now: float) -> Observation:
    # Rank 2 waits with the others; rank 3 finished #41 and never entered #42.
    return _obs(now, (_rank(2, "node-b", now, pending=True, last=10),
                      _rank(3, "node-b", now, pending=False, last=11.9)))  # fmt: skip


def _doc(obs: Observation, node: str, wall: float) -> dict:
    return json.loads(json.dumps(view_document(obs, node, wall)))  # as it travels: JSON


def test_round_trip_moves_times_to_the_readers_clock() -> None:
    doc = _doc(_node_b(5000.0), "node-b", wall=1_000_000.0)
    # The reader's clock is elsewhere, and it reads 1.5 s after the writing.
    a_now = 70.0
    r2, r3 = snapshots_from(doc, a_now, wall=1_000_001.5)
    assert (r2.rank, r2.node, r3.rank) == (2, "node-b", 3)
    assert abs(r2.pending[0].t_enqueue - (a_now - 1.5 - 10)) < 1e-6
    assert abs(r3.last_activity - (a_now - 1.5 - 11.9)) < 1e-6
    assert r3.last_ops["0"].group_seq == 41 and r3.last_ops["0"].state == OpState.COMPLETED
    assert doc["world_size"] == 4 and groups_from(doc) == {"0": (0, 1, 2, 3)}


def test_groups_travel_as_spans() -> None:
    obs = Observation(
        now=1.0, ranks=(), world_size=16000, job="j",
        groups={"0": tuple(range(16000)), "dp": (0, 1, 2, 8, 9, 15)},
    )  # fmt: skip
    doc = _doc(obs, "n", 1.0)
    assert doc["groups"] == {"0": [[0, 15999]], "dp": [[0, 2], [8, 9], [15, 15]]}
    assert groups_from(doc)["dp"] == (0, 1, 2, 8, 9, 15)
    assert len(json.dumps(doc)) < 400  # not 16,000 numbers


def test_one_node_alone_leaves_the_culprit_to_the_job_verdict() -> None:
    a = _node_a(100.0)
    assert {(s.rank, s.kind) for s in find_suspects(a)} == {
        (2, SuspectKind.REMOTE),
        (3, SuspectKind.REMOTE),
    }
    v = decide(WatchState(), a, Policy(timeouts=TimeoutPolicy(floor=2.0))).verdict
    assert v is not None and v.culprit is None
    assert "ranks on other nodes (ranks 2, 3)" in v.summary
    assert "job verdict names the culprit" in v.summary


def test_the_views_together_name_the_rank_behind_and_its_node() -> None:
    views = [_doc(_node_a(100.0), "node-a", 5000.0), _doc(_node_b(9.0), "node-b", 5000.2)]
    a = analyse(views, now_wall=5001.0)
    assert (a.culprit, a.node) == (3, "node-b")
    assert "rank 3 on node node-b never joined" in a.reason


def test_views_without_the_culprit_name_it_only_when_one_rank_is_missing() -> None:
    only_a = [_doc(_node_a(100.0), "node-a", 5000.0)]
    a = analyse(only_a, now_wall=5001.0)
    assert a.culprit is None and "no report carries 2 ranks (2-3)" in a.reason
    b_alone = _obs(9.0, (_rank(2, "node-b", 9.0, pending=True, last=10),))
    three = [*only_a, _doc(b_alone, "node-b", 5000.0)]
    a = analyse(three, now_wall=5001.0)
    assert (a.culprit, a.node) == (3, "") and "no node reported rank 3" in a.reason
    # Broken or foreign documents are left out, not fatal.
    junk = [{"format": "something else"}, {"format": "diag.view/1", "ranks": "x"}]
    assert analyse(junk, now_wall=1.0).culprit is None


def test_claimant_without_a_first_hand_report_reads_every_view(tmp_path: Path) -> None:
    """Neither node blames one of its own ranks (node-b's agent saw rank 3 as waiting for a
    step boundary, say): after the settle time the claimant reads both views and names rank 3
    on node-b, with the reason."""
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=5.0)
    wall = 5000.0
    for node, obs in (("node-a", _node_a(100.0)), ("node-b", _node_b(9.0))):
        store.file("j", "inc", NodeReport(
            node, None, Where.REMOTE, str(tmp_path / "timeline" / f"e-{node}"),
            view=view_document(obs, node, wall),
        ))  # fmt: skip
    assert store.conclude("j", "inc", first_seen=wall, now_wall=wall + 1, force=False) is None
    v = store.conclude("j", "inc", first_seen=wall, now_wall=wall + 5.5, force=True)
    assert v is not None and (v.culprit, v.culprit_node) == (3, "node-b")
    assert v.basis.startswith("from the views of 2 nodes: ") and "never joined" in v.basis
    assert store.io.reads == 2
    # The verdict names the culprit's node; both filed (the other's directory is found by
    # its name, not listed in the verdict).
    assert v.nodes == ("node-b",) and v.reports == 2


def test_long_rank_lists_fold_into_spans() -> None:
    listed = ",".join(str(r) for r in range(128000) if r != 7)
    assert fold_rank_lists(f"ranks {listed} wait in all_reduce #42") == (
        "ranks 0-6,8-127999 wait in all_reduce #42"
    )
    assert (
        fold_rank_lists("ranks 2,3 wait; rank 12 at step 7") == "ranks 2,3 wait; rank 12 at step 7"
    )
    every_other = ",".join(str(r) for r in range(0, 20000, 2))
    folded = fold_rank_lists(f"ranks {every_other} wait")
    assert folded.startswith("ranks 0,2,4,6,8,10,12,14,... (10000 ranks in 10000 runs) ...,19996")
    assert len(folded) < 100


def test_views_of_half_the_nodes_still_name_the_rank_behind() -> None:
    """Nodes whose agents are gone file nothing: the analysis runs over the views there are
    (ranks missing from view are shared, not copied per waiting rank)."""
    now, n = 100.0, 400
    views = []
    for node in range(0, n, 2):  # every other node filed
        ranks = tuple(
            replace(
                _rank(r, f"node-{node}", now, pending=r != 7, last=11.9 if r == 7 else 10),
                local_rank=r % 8,
            )
            for r in range(node * 8, node * 8 + 8)
        )
        views.append(_doc(_obs(now, ranks, world=n * 8), f"node-{node}", 5000.0))
    a = analyse(views, now_wall=5001.0)
    assert (a.culprit, a.node) == (7, "node-0"), a.reason


def test_ranks_that_only_wait_travel_compact_and_read_back_the_same() -> None:
    """A rank in one collective with nothing else to tell is a row of numbers under its op
    (`waiting`); one that is anything else keeps its full entry. Read back, each is the
    snapshot its full entry gives."""
    now = 5000.0
    busy = replace(_rank(4, "node-b", now, pending=True, last=10), phase="backward", cpu_busy=0.7)
    obs = _obs(now, (*_node_b(now).ranks, busy), world=5)
    doc = _doc(obs, "node-b", wall=1000.0)
    assert [row[0] for b in doc["waiting"] for row in b["ranks"]] == [2]
    assert doc["waiting"][0]["op"] == {
        "group": "0", "seq": 42, "op": "ALL_REDUCE", "state": "ENQUEUED", "nbytes": 64, "peer": -1,
    }  # fmt: skip
    assert sorted(r["rank"] for r in doc["ranks"]) == [3, 4]
    back = {s.rank: s for s in snapshots_from(doc, now, wall=1000.0)}
    # Built field by field at once (waiters.expand): equal to the snapshot constructed.
    op = back[2].pending[0]
    assert back[2] == RankSnapshot(
        rank=2, local_rank=0, pid=102, node="node-b", liveness=Liveness.RUNNING, started_at=0.0,
        last_activity=back[2].last_activity, step=7, pending=(op,), last_ops={"0": op},
    )  # fmt: skip
    assert op == OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, op.t_enqueue)
    for r in obs.ranks:
        s = back[r.rank]
        assert (s.local_rank, s.pid, s.step, s.phase, s.cpu_busy, s.liveness) == (
            r.local_rank, r.pid, r.step, r.phase, r.cpu_busy, r.liveness,
        )  # fmt: skip
        assert abs(s.last_activity - r.last_activity) < 1e-3
        assert [
            (o.group, o.group_seq, o.op, o.state, round(o.t_enqueue, 3)) for o in s.pending
        ] == [(o.group, o.group_seq, o.op, o.state, round(o.t_enqueue, 3)) for o in r.pending]
        assert {g: o.group_seq for g, o in s.last_ops.items()} == {
            g: o.group_seq for g, o in r.last_ops.items()
        }
    # The analysis finds what it found from full entries: rank 3 behind.
    a = analyse(
        [_doc(_node_a(now), "node-a", 1000.0), _doc(_node_b(now), "node-b", 1000.0)], 1001.0
    )
    assert (a.culprit, a.node) == (3, "node-b") and "never joined" in a.reason
