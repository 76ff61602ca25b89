"""The job verdict: the pure choice of culprit, and the file adapter on a real directory, with
real processes racing for the claim."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from diag.agent.job.decisions import Claim
from diag.agent.job.verdict import (
    JOB_VERDICT_FILE,
    JobVerdictStore,
    NodeReport,
    ReportName,
    Where,
    parse_name,
    pick_culprit,
    ready,
)


def _name(node: str, rank: int | None, where: Where) -> ReportName:
    r = NodeReport(node=node, culprit=rank, where=where, evidence=f"/t/20261124-hang-{node}")
    parsed = parse_name(r.name())
    assert parsed is not None
    return parsed


def test_report_name_round_trips() -> None:
    r = NodeReport(node="gpu-node.7", culprit=12, where=Where.LOCAL, evidence="/t/x-hang-gpu")
    assert parse_name(r.name()) == ReportName(
        node="gpu-node.7", culprit=12, where=Where.LOCAL, file=r.name(), evidence_name="x-hang-gpu"
    )
    none = NodeReport(node="n", culprit=None, where=Where.REMOTE, evidence="/t/e")
    assert parse_name(none.name()).culprit is None  # type: ignore[union-attr]
    assert parse_name("junk") is None
    assert parse_name(".r1.L.n~e.tmp") is None  # write_atomic's temporary files


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        # The culprit's own node outweighs any number of nodes that blame another rank.
        (
            [("a", 7, Where.REMOTE), ("b", 7, Where.REMOTE), ("c", 3, Where.LOCAL)],
            (3, "c", "first-hand"),
        ),
        # Nobody first-hand: the rank most nodes blame, node unknown.
        (
            [("a", 7, Where.REMOTE), ("b", 7, Where.REMOTE), ("c", 5, Where.REMOTE)],
            (7, "", "named by 2 of 3"),
        ),
        # A tie goes to the lower rank, so every agent that assembles picks the same.
        ([("a", 9, Where.REMOTE), ("b", 4, Where.REMOTE)], (4, "", "named by 1 of 2")),
        ([("a", None, Where.REMOTE)], (None, "", "no node named")),
    ],
)
def test_pick_culprit(
    names: list[tuple[str, int | None, Where]], expected: tuple[int | None, str, str]
) -> None:
    rank, node, basis = pick_culprit([_name(*n) for n in names])
    assert (rank, node) == expected[:2]
    assert basis.startswith(expected[2]) or expected[2] in basis


def test_ready_waits_for_the_culprit_node_or_the_settle_time() -> None:
    remote = [_name("a", 3, Where.REMOTE)]
    assert not ready(remote, first_seen=100.0, now=105.0, settle=10.0)
    assert ready(remote, first_seen=100.0, now=110.0, settle=10.0)
    assert ready([*remote, _name("b", 3, Where.LOCAL)], first_seen=100.0, now=100.5, settle=10.0)


def test_store_assembles_one_verdict_reading_only_the_culprit_node(tmp_path: Path) -> None:
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=60.0)
    reports = [
        NodeReport(f"node-{i}", 5, Where.REMOTE, str(tmp_path / "timeline" / f"e-{i}"))
        for i in range(20)
    ]
    reports.append(NodeReport("node-x", 5, Where.LOCAL, str(tmp_path / "timeline" / "e-x")))
    claims = [store.file("job", "a0-hang-g0-7", r) for r in reports]
    assert claims == [True] + [False] * 20
    v = store.conclude("job", "a0-hang-g0-7", first_seen=0.0, now_wall=1.0, force=False)
    assert v is not None
    assert (v.culprit, v.culprit_node) == (5, "node-x")
    assert v.first_hand is not None and v.first_hand.evidence.endswith("e-x")
    # The verdict names the first-hand node only, however many filed: the other nodes'
    # directories are found by their names (evidence_glob), not listed one by one.
    assert (v.nodes, v.evidence, v.reports) == (
        ("node-x",),
        (str(tmp_path / "timeline" / "e-x"),),
        21,
    )
    assert v.evidence_glob == str(tmp_path / "timeline" / "*@job-a0-hang-g0-7")
    assert store.io.reads == 1  # the culprit node's report, nothing else
    # A second assembly (another agent after a crash of the first) does not replace it.
    store.publish(
        store.incident_dir("job", "a0-hang-g0-7"), v.__class__(**{**v.__dict__, "culprit": 1})
    )
    again = store.load("job", "a0-hang-g0-7")
    assert again is not None and again.culprit == 5
    doc = json.loads((store.incident_dir("job", "a0-hang-g0-7") / JOB_VERDICT_FILE).read_text())
    assert doc["format"] == "diag.job-verdict/1"


def _race(root: str, i: int, q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    store = JobVerdictStore(Path(root), settle=60.0)
    r = NodeReport(f"n{i}", 2, Where.LOCAL if i == 2 else Where.REMOTE, f"/t/e{i}")
    q.put(store.file("j", "inc", r))


def test_processes_racing_make_one_claimant(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), i, q)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    claims = [q.get(timeout=10) for _ in procs]
    assert claims.count(True) == 1
    assert len(JobVerdictStore(tmp_path).names("j", "inc")) == 8


def test_nodes_reporting_after_an_early_verdict_are_added(tmp_path: Path) -> None:
    store = JobVerdictStore(tmp_path / ".jobs", settle=1.0, poll=0.05)
    store.file("j", "inc", NodeReport("b", 3, Where.LOCAL, str(tmp_path / "eb")))
    first = time.time()
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(store.wait_and_conclude("j", "inc", first)))
    t.start()
    deadline = time.time() + 30
    while store.load("j", "inc") is None and time.time() < deadline:
        time.sleep(0.01)
    early = store.load("j", "inc")
    assert early is not None and early.nodes == ("b",)
    # A late first-hand report (node a saw its own rank 6 go wrong) is named; a late view
    # (node c) is only counted: its directory is found by its name.
    store.file("j", "inc", NodeReport("a", 6, Where.LOCAL, str(tmp_path / "ea")))
    store.file("j", "inc", NodeReport("c", 3, Where.REMOTE, str(tmp_path / "ec")))
    t.join(60)
    final = store.load("j", "inc")
    assert final is not None and final.nodes == ("a", "b") and final.culprit_node == "b"
    assert final.evidence == (str(tmp_path / "ea"), str(tmp_path / "eb"))
    assert (final.culprit, final.reports) == (3, 3)


def test_known_lists_the_attempt_and_reads_only_this_runs_claims(tmp_path: Path) -> None:
    store = JobVerdictStore(tmp_path / ".jobs")
    for inc, node in (
        ("a0-hang-pg0-seq42", "old"),
        ("a0-rank_exited", "a"),
        ("a1-rank_exited", "b"),
    ):
        store.file("j", inc, NodeReport(node, 1, Where.LOCAL, f"/t/{node}", first_sign_wall=5.0))
    old = store.incident_dir("j", "a0-hang-pg0-seq42") / "claim"
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # an earlier run of the job
    reader = JobVerdictStore(tmp_path / ".jobs")
    known = {k.incident_id: k for k in reader.known("j", 0, since_wall=time.time() - 60)}
    assert set(known) == {"a0-hang-pg0-seq42", "a0-rank_exited"}  # attempt 0 only
    assert known["a0-hang-pg0-seq42"].claim is None  # its time says enough
    assert known["a0-rank_exited"].claim == Claim("a", Where.LOCAL, 1, 5.0)
    assert (reader.io.listings, reader.io.reads) == (1, 1)


def test_a_first_hand_report_after_a_waiting_nodes_claim_ends_the_wait(tmp_path: Path) -> None:
    """A node that filed its view (no first-hand report within its settle time) holds the
    claim; the culprit's node reports after all. The claimant learns it from one marker and
    concludes first-hand without waiting out its settle time."""
    store = JobVerdictStore(tmp_path / ".jobs", settle=8.0, poll=0.05)
    assert store.file("j", "inc", NodeReport("a", None, Where.REMOTE, str(tmp_path / "ea")))
    first = time.time()
    t = threading.Thread(target=store.wait_and_conclude, args=("j", "inc", first))
    t.start()
    time.sleep(0.3)
    # While it waits, it reads the claim, and each view once as it comes (to conclude as soon as
    # the views hold every rank), not once per look.
    assert store.load("j", "inc") is None and store.io.reads == 2 and store.io.listings >= 2
    late = JobVerdictStore(tmp_path / ".jobs")
    assert not late.file("j", "inc", NodeReport("b", 3, Where.LOCAL, str(tmp_path / "eb")))
    assert (store.incident_dir("j", "inc") / "first-hand").is_file()
    t.join(60)
    v = store.load("j", "inc")
    assert v is not None and (v.culprit, v.culprit_node, v.reports) == (3, "b", 2)
    assert v.decided_wall < first + store.settle  # concluded on the marker, not at the end


def test_a_fallback_concludes_once_the_views_hold_every_rank(tmp_path: Path) -> None:
    """No node blames its own rank: the claimant reads each view once as it comes and reaches
    the verdict as soon as the views hold every rank of the job, not at the end of its settle
    time; with a node's view missing it waits the settle time out."""
    from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
    from diag.agent.job.nodeview import view_document
    from diag.formats.records import OpCode, OpState

    def view(node: int, now: float) -> dict:
        done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 64, now - 12, now - 11.9)
        stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, now - 10)
        ranks = tuple(
            RankSnapshot(
                rank=r, local_rank=r % 2, pid=100 + r, node=f"n{node}", liveness=Liveness.RUNNING,
                started_at=0.0, last_activity=now - 10, step=7,
                pending=() if r == 3 else (stuck,), last_ops={"0": done if r == 3 else stuck},
            )
            for r in (2 * node, 2 * node + 1)
        )  # fmt: skip
        obs = Observation(now=now, ranks=ranks, groups={"0": (0, 1, 2, 3)}, world_size=4)
        return view_document(obs, f"n{node}", time.time())

    for nodes, early in (((0, 1), True), ((0,), False)):
        store = JobVerdictStore(tmp_path / f".jobs{len(nodes)}", settle=3.0, poll=0.05)
        first = time.time()
        for i in nodes:
            report = NodeReport(f"n{i}", None, Where.REMOTE, str(tmp_path / f"e{i}"),
                                view=view(i, 100.0), wall=time.time())  # fmt: skip
            store.file("j", "inc", report)
        v = store.wait_and_conclude("j", "inc", first)
        assert v is not None and (v.decided_wall < first + 1.0) == early, v
        assert store.io.reads == 1 + len(nodes)  # the claim, and each view once
        if early:
            assert (v.culprit, v.culprit_node) == (3, "n1"), v.basis


def test_views_filed_early_conclude_once_they_hold_every_rank_and_a_changed_mind_still_wins(
    tmp_path: Path,
) -> None:
    """Views filed `view_after` seconds after the nodes' verdicts: once they hold every rank the
    claimant concludes from them after the quiet time, well before the settle time since it
    filed its own; a node that reports its own rank first-hand after its view (it
    changed its mind) before the verdict is in place wins."""
    from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
    from diag.agent.job.nodeview import view_document
    from diag.formats.records import OpCode, OpState

    def view(node: int, now: float) -> dict:
        stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, now - 10)
        done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 64, now - 12, now - 11.9)
        ranks = tuple(
            RankSnapshot(
                rank=r, local_rank=r % 2, pid=100 + r, node=f"n{node}", liveness=Liveness.RUNNING,
                started_at=0.0, last_activity=now - 10, step=7,
                pending=() if r == 3 else (stuck,), last_ops={"0": done if r == 3 else stuck},
            )
            for r in (2 * node, 2 * node + 1)
        )  # fmt: skip
        obs = Observation(now=now, ranks=ranks, groups={"0": (0, 1, 2, 3)}, world_size=4)
        return view_document(obs, f"n{node}", time.time())

    for changed_mind in (False, True):
        root = tmp_path / f".jobs-{changed_mind}"
        store = JobVerdictStore(root, settle=3.0, poll=0.05, view_after=0.2, quiet=0.3)
        assert store.view_after == 0.2
        decided = time.time()
        for i in (0, 1):
            store.file("j", "inc", NodeReport(f"n{i}", None, Where.REMOTE, str(tmp_path / f"e{i}"),
                                              view=view(i, 100.0), wall=time.time()))  # fmt: skip
        if changed_mind:
            # n1 reports its own rank 3 after its view: the marker tells the claimant.
            JobVerdictStore(root).file(
                "j", "inc", NodeReport("n1", 3, Where.LOCAL, str(tmp_path / "e1"))
            )
        v = store.wait_and_conclude("j", "inc", time.time())
        assert v is not None and (v.culprit, v.culprit_node) == (3, "n1"), v
        assert v.decided_wall < decided + store.settle  # neither waited the settle time out
        if changed_mind:
            assert v.basis.startswith("first-hand") and v.nodes == ("n1",)
            assert store.covered_wall is None  # concluded on the report, the views not analysed
        else:
            assert v.basis.startswith("from the views of 2 nodes") and "never joined" in v.basis
            assert store.covered_wall is not None
            assert v.decided_wall >= store.covered_wall + store.quiet
        # The claim, and each view once; with a first-hand report known, that report only.
        assert store.io.reads == (2 if changed_mind else 3)
