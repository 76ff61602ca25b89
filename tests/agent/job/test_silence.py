"""A node that goes silent at a death is the suspect: the pure judgement of the peers a
claimant probed, the culprit it names, and the verdict the store assembles and reads back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from diag.agent.job.decisions import NodeReport, ReportName, Where, parse_name
from diag.agent.job.silence import LostNode, PeerLook, Silence, blame_lost, judge, victims
from diag.agent.job.verdict import JobVerdictStore

LOST_AFTER, SLACK = 5.0, 6.0


@pytest.mark.parametrize(
    ("peers", "now", "expected"),
    [
        # Every peer answers: nobody is lost, no wait.
        ([PeerLook("b", (2, 3), True, 100.0)], 101.0, Silence((), None)),
        # Silent for less than `lost_after`: look again when it would be lost.
        ([PeerLook("b", (2, 3), False, 100.0)], 101.0, Silence((), 105.0)),
        # Silent for `lost_after`: lost, its ranks with it.
        (
            [PeerLook("b", (3, 2), False, 100.0)],
            105.5,
            Silence((LostNode("b", (2, 3), 5.5),), None),
        ),
        # Not probed yet: look again now.
        ([PeerLook("b", (), None, 0.0)], 101.0, Silence((), 101.0)),
        # One lost, one still to judge: the wait goes on for the second.
        (
            [PeerLook("b", (2,), False, 90.0), PeerLook("c", (4,), False, 100.0)],
            101.0,
            Silence((LostNode("b", (2,), 11.0),), 105.0),
        ),
        # Past the claimant's bound (its first look at 100, + lost_after + slack): no more
        # waiting; a peer never judged counts as there.
        ([PeerLook("b", (), None, 0.0)], 111.0, Silence((), None)),
        # The one silent longest first.
        (
            [PeerLook("c", (4,), False, 99.0), PeerLook("b", (2,), False, 95.0)],
            104.0,
            Silence((LostNode("b", (2,), 9.0), LostNode("c", (4,), 5.0)), None),
        ),
    ],
)
def test_judge(peers: list[PeerLook], now: float, expected: Silence) -> None:
    assert judge(peers, now=now, lost_after=LOST_AFTER, started=100.0, slack=SLACK) == expected


@pytest.mark.parametrize(
    ("started", "expected"),
    [
        # Its agent started afresh while this node's ranks ran, a minute before they failed:
        # lost and back (a preempted pod replaced, a rebooted node), its ranks with it.
        (1040.0, (LostNode("b", (2, 3), 0.0, 1040.0),)),
        # Started with the job (within RUN_GAP of the ranks' start: agents start with their
        # launchers, before the rendezvous): there all along.
        (1005.0, ()),
        # Restarted long before the failure (CAME_BACK_S): not what failed now.
        (700.0, ()),
        (None, ()),  # an agent that does not say (an older one)
    ],
)
def test_judge_a_peer_that_came_back(started: float | None, expected: tuple) -> None:
    peers = [PeerLook("b", (3, 2), True, 1100.0, started)]
    got = judge(peers, now=1101.0, lost_after=LOST_AFTER, started=1100.0, slack=SLACK,
                ranks_since=1000.0 - 300.0 if started == 700.0 else 1000.0, first_sign=1100.0)  # fmt: skip
    assert got == Silence(expected, None)
    # Without the claimant's times (a view filed for a hang), nobody came back.
    assert judge(peers, now=1101.0, lost_after=LOST_AFTER, started=1100.0, slack=SLACK).lost == ()


def test_the_basis_says_the_node_came_back() -> None:
    names = [_name("node-a", 0, Where.LOCAL)]
    rank, node, basis = blame_lost(names, [LostNode("node-b", (2, 3), 0.0, 1795874663.0)])
    assert (rank, node) == (2, "node-b")
    assert "node node-b was lost and came back: its agent started afresh at" in basis, basis
    assert "rank 0 on node-a died after it (victims" in basis, basis


def _name(node: str, rank: int | None, where: Where) -> ReportName:
    r = NodeReport(node=node, culprit=rank, where=where, evidence=f"/t/20261128-death-{node}")
    parsed = parse_name(r.name())
    assert parsed is not None
    return parsed


def test_the_lost_node_is_the_culprit_and_the_deaths_elsewhere_its_victims() -> None:
    names = [_name("node-a", 0, Where.LOCAL), _name("node-c", 5, Where.LOCAL),
             _name("node-d", None, Where.REMOTE)]  # fmt: skip
    lost = [LostNode("node-b", (2, 3), 6.2)]
    rank, node, basis = blame_lost(names, lost)
    assert (rank, node) == (2, "node-b")
    assert "node node-b went silent" in basis and "ranks 2,3 vanished" in basis, basis
    assert "rank 0 on node-a, rank 5 on node-c died after it (victims" in basis, basis
    assert "the ranks of node-d waited for it" in basis, basis
    assert [n.node for n in victims(names, lost)] == ["node-a", "node-c"]
    # Its ranks unknown (no replica of it held): the node is still named, no rank.
    assert blame_lost(names, [LostNode("node-b", (), 6.0)])[:2] == (None, "node-b")


def test_the_store_puts_the_lost_node_in_the_verdict_and_reads_it_back(tmp_path: Path) -> None:
    """The survivor's rank died first-hand, but its peer's agent went silent: the verdict in
    place names the lost node, lists it, and keeps the survivor's evidence as its victim's."""
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=0.5, poll=0.05, cascade=0.0)
    evidence = str(tmp_path / "timeline" / "20261128-death-node-a")
    report = NodeReport("node-a", 0, Where.LOCAL, evidence, kind="rank_exited",
                        first_sign_wall=time.time())  # fmt: skip
    assert store.file("job", "a0-rank_exited", report)
    lost = (LostNode("node-b", (1,), 5.0),)
    v = store.wait_and_conclude("job", "a0-rank_exited", time.time(), None, lost)
    assert v is not None
    assert (v.culprit, v.culprit_node, v.lost_nodes) == (1, "node-b", ("node-b",)), v
    assert "victims" in v.basis and "rank 0 on node-a" in v.basis, v.basis
    assert v.evidence == (evidence,)
    back = store.load("job", "a0-rank_exited")
    assert back is not None and back.lost_nodes == ("node-b",) and back.culprit_node == "node-b"


def test_a_verdict_of_an_older_agent_reads_with_no_lost_node(tmp_path: Path) -> None:
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=0.5, poll=0.05, cascade=0.0)
    report = NodeReport("node-a", 0, Where.LOCAL, str(tmp_path / "timeline" / "e"))
    assert store.file("job", "a0-rank_exited", report)
    assert store.wait_and_conclude("job", "a0-rank_exited", time.time()) is not None
    path = store.incident_dir("job", "a0-rank_exited") / "job-verdict.json"
    text = path.read_text()
    assert '"lost_nodes": []' in text
    path.unlink()
    path.write_text(text.replace('"lost_nodes": [],', "").replace(',\n "lost_nodes": []', ""))
    back = store.load("job", "a0-rank_exited")
    assert back is not None and back.lost_nodes == () and back.culprit_node == "node-a"
