"""A holder writes a lost peer's replica to storage (agent.replication.Handoff), with real
replicators on loopback and a real checkpoint manager: once the holder's own ranks are stopped
and persisted, a peer whose agent no longer answers gets its replica's parts written, the files
the same records its own persist would have written, and the step both nodes hold complete commits.
A peer whose agent answers persists its own: nothing of it is written, unless it goes silent
before its parts are on storage."""

from __future__ import annotations

import logging
import time
import zipfile
from pathlib import Path

import pytest
from jobrun import free_port
from polling import wait_for
from replica_helpers import JOB, OWNERS, fill

from diag.agent.checkpoint.manager import CheckpointManager, CheckpointSettings
from diag.agent.checkpoint.persist import persist_slot
from diag.agent.checkpoint.storage import marker_runs
from diag.agent.job.decisions import Mine
from diag.agent.job.link import JobLink
from diag.agent.job.verdict import JobVerdictStore, NodeReport, Where
from diag.agent.loop.peerwatch import PeerWatch
from diag.agent.loop.replication import Handoff
from diag.agent.replica.replicator import NodeAddress, ReplicaSettings, Replicator
from diag.formats.snapshot import read_latest_step, slot_path, writing_marker_path


@pytest.fixture
def ring(tmp_path):
    """Nodes a (ranks 0, 1) and b (ranks 2, 3) holding each other's step 4; a's manager and
    handoff, wired as the agent wires them."""
    nodes = tuple(NodeAddress(n, "127.0.0.1", free_port()) for n in ("a", "b"))
    settings = ReplicaSettings(
        nodes, factor=1, token="t", max_bytes=256 << 20, interval=0.05, lost_after=0.3
    )
    save = tmp_path / "save"
    save.mkdir()
    reps = {}
    for node, ranks in (("a", (0, 1)), ("b", (2, 3))):
        run_dir = tmp_path / f"{node}-run"
        run_dir.mkdir()
        fill(run_dir, save, {r: [3, 4] for r in ranks}, node=node)
        reps[node] = Replicator(settings, run_dir=run_dir, job=JOB, node=node, owners=OWNERS)
        reps[node].start()
    a, b = reps["a"], reps["b"]
    assert wait_for(lambda: a.stats().held.get("b") == 4 and b.stats().held.get("a") == 4, 60)
    manager = CheckpointManager(a.run_dir, JOB, CheckpointSettings(), owners=OWNERS)
    handoff = Handoff(a, manager)
    manager.stopped_hooks.append(handoff.ranks_stopped)
    try:
        yield a, b, manager, handoff, save
    finally:
        handoff.close()
        manager.close(5)
        for r in (a, b):
            r.close()


def files_of(save: Path, step: int, ranks: tuple[int, ...]) -> dict[str, bytes]:
    """Every record of each rank's file but `.data/serialization_id`, which names one write."""
    out = {}
    for rank in ranks:
        with zipfile.ZipFile(save / f"global_step{step}" / f"zero_pp_rank_{rank}_optim.pt") as z:
            for info in z.infolist():
                if not info.filename.endswith("/.data/serialization_id"):
                    out[info.filename] = z.read(info)
    return out


def test_a_lost_peer_s_replica_is_written_and_the_step_commits(ring, tmp_path):
    a, b, manager, handoff, save = ring
    mark = writing_marker_path(a.run_dir, JOB)
    b.close()  # node b is lost: its agent answers no more
    manager.persist_all_jobs({JOB})  # a's ranks were stopped: their own parts first
    # a restart at another size waits on this mark: it outlives the persist of a's own parts
    # while b's replica is still to come (b not yet silent for --replica-lost-after)
    assert mark.exists() or read_latest_step(save) == 4
    handoff.join(30)
    assert read_latest_step(save) == 4
    assert not mark.exists(), "the mark outlived the handover"
    assert marker_runs(save, 4) == {0: "r1", 1: "r1", 2: "r1", 3: "r1"}
    assert handoff.stats().steps == {"b": 4}
    # the same records b's agent would have written from b's own slots
    ref = tmp_path / "ref"
    ref.mkdir()
    for rank in (2, 3):
        r = persist_slot(slot_path(b.run_dir, JOB, rank, 1), step=4, save_dir=ref, owners=OWNERS)
        assert r.ok, r.error
    assert files_of(save, 4, (2, 3)) == files_of(ref, 4, (2, 3))

    # a second stop of a's ranks writes nothing again
    mtime = (save / ".diag" / "global_step4" / "rank00002.done").stat().st_mtime_ns
    manager.persist_all_jobs({JOB})
    handoff.join(30)
    assert (save / ".diag" / "global_step4" / "rank00002.done").stat().st_mtime_ns == mtime


def test_a_peer_whose_agent_answers_persists_its_own(ring, caplog):
    _, b, manager, handoff, save = ring
    caplog.set_level(logging.INFO, logger="diag.agent.loop.replication")
    manager.persist_all_jobs({JOB})
    assert wait_for(lambda: "replica of b (step 4): alive" in caplog.text, 60)
    assert set(marker_runs(save, 4)) == {0, 1}  # a's own parts only
    # b persists its own: nothing of b's is to come from a, so a restart need not wait for a
    mark = writing_marker_path(handoff.replicator.run_dir, JOB)
    assert wait_for(lambda: not mark.exists(), 10)
    # b's agent persists its ranks' parts: a stops watching, having written nothing of b
    for rank in (2, 3):
        r = persist_slot(slot_path(b.run_dir, JOB, rank, 1), step=4, owners=OWNERS)
        assert r.ok, r.error
    handoff.join(30)
    assert read_latest_step(save) == 4
    assert handoff.stats().steps == {}
    assert "is lost" not in caplog.text


def test_a_peer_that_answered_then_goes_silent_is_written(ring, caplog):
    _, b, manager, handoff, save = ring
    caplog.set_level(logging.INFO, logger="diag.agent.loop.replication")
    manager.persist_all_jobs({JOB})
    assert wait_for(lambda: "replica of b (step 4): alive" in caplog.text, 60)
    b.close()
    handoff.join(30)
    assert read_latest_step(save) == 4
    assert handoff.stats().steps == {"b": 4}


def test_the_job_verdict_names_a_peer_whose_agent_went_silent(ring, tmp_path):
    """The claimant's side of a whole-node loss, with the agent's real parts (no job): node a's
    rank died and a claims the job's incident first-hand; before it concludes it probes its
    neighbour b, whose agent is gone. The verdict names b (its ranks from the replica a holds),
    lists it as lost, and a's own death is its victim."""
    a, b, _, _, _ = ring
    watch = PeerWatch(a)
    (look,) = watch()
    assert (look.node, look.ranks, look.answers) == ("b", (2, 3), True)
    b.close()  # node b is lost: its agent answers no more
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=2.0, poll=0.05, cascade=0.0)
    link = JobLink(store, "a", peers=watch, lost_after=a.settings.lost_after)
    report = NodeReport("a", 0, Where.LOCAL, str(tmp_path / "timeline" / "e-a"),
                        kind="rank_exited", first_sign_wall=time.time())  # fmt: skip
    assert store.file(JOB, "a0-rank_exited", report)
    link._conclude(JOB, "a0-rank_exited", time.time())
    v = store.load(JOB, "a0-rank_exited")
    assert v is not None
    assert (v.culprit, v.culprit_node, v.lost_nodes) == (2, "b", ("b",)), v
    assert "rank 0 on a died after it (victims" in v.basis, v.basis


def test_the_job_verdict_names_a_peer_that_was_lost_and_came_back(ring, tmp_path):
    """Node b was lost and is back before a's rank fails (a preempted pod replaced): its agent,
    started afresh while a's ranks ran, answers a's probe and says when it started. The verdict
    names b, not a's rank, which died after it."""
    a, b, _, _, _ = ring
    ranks_since = time.time()
    time.sleep(0.2)
    b.close()
    again = Replicator(b.settings, run_dir=b.run_dir, job=JOB, node="b", owners=OWNERS)
    again.start()
    try:
        store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=0.5, poll=0.05,
                                cascade=0.0)  # fmt: skip
        link = JobLink(store, "a", peers=PeerWatch(a), lost_after=a.settings.lost_after)
        first = time.time() + 20.0  # its agent restarted 20 s before a's rank failed
        report = NodeReport("a", 0, Where.LOCAL, str(tmp_path / "timeline" / "e-a"),
                            kind="rank_exited", first_sign_wall=first)  # fmt: skip
        assert store.file(JOB, "a0-rank_exited", report)
        mine = Mine("a0-rank_exited", Where.LOCAL, first, first, ranks_since - 20.0)
        link._conclude(JOB, "a0-rank_exited", time.time(), mine)
        v = store.load(JOB, "a0-rank_exited")
        assert v is not None
        assert (v.culprit, v.culprit_node, v.lost_nodes) == (2, "b", ("b",)), v
        assert "node b was lost and came back" in v.basis, v.basis
    finally:
        again.close()


def test_the_job_verdict_stands_while_the_peer_answers(ring, tmp_path):
    a, _, _, _, _ = ring
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=0.5, poll=0.05, cascade=0.0)
    link = JobLink(store, "a", peers=PeerWatch(a), lost_after=a.settings.lost_after)
    report = NodeReport("a", 0, Where.LOCAL, str(tmp_path / "timeline" / "e-a"))
    assert store.file(JOB, "a0-rank_exited", report)
    link._conclude(JOB, "a0-rank_exited", time.time())
    v = store.load(JOB, "a0-rank_exited")
    assert v is not None and (v.culprit, v.culprit_node, v.lost_nodes) == (0, "a", ()), v
