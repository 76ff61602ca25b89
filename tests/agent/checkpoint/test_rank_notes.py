"""What the ranks tell the agent beside persist requests, over the real control channel (gRPC on
a unix socket, the trainer's real client): a rank naming another node than the agent's is named
on both sides at registration and counted; a resume from storage although a step was in memory
is logged with what each rank held and counted once per launch; replication's state reaches the
ranks when they subscribe and when the holders confirm a newer round step; a completed round
snapshot wakes the pushes."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from polling import wait_for

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.ranknotes import RankNotes, ReplicaState
from diag.agent.checkpoint.service import ControlServer
from diag.formats.rundir import control_socket_path
from diag.trainer.control.client import ControlClient
from diag.trainer.control.identity import ClientIdentity, ResumeNote
from diag.trainer.control.message import ReplicaAck

JOB = "notes"


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-notes-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def agent(run_dir: Path):
    manager = CheckpointManager(run_dir, None)
    notes = RankNotes("worker-1", manager.sessions)
    server = ControlServer(control_socket_path(run_dir, JOB), manager, notes=notes).start()
    try:
        yield notes
    finally:
        server.stop()
        manager.close(timeout=10)


@pytest.fixture
def clients(run_dir: Path):
    made: list[ControlClient] = []

    def make(rank: int, node: str) -> ControlClient:
        ident = ClientIdentity(JOB, rank, 2, rank, 0, node, os.getpid() + rank)
        c = ControlClient(run_dir, ident, journal=f"/j{rank}").start()
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.mark.timeout(60)
def test_a_rank_naming_another_node_is_named_on_both_sides(agent: RankNotes, clients, caplog):
    caplog.set_level(logging.INFO)
    same = clients(0, "worker-1")
    other = clients(1, "ip-10-0-0-7")
    assert same.wait_connected(20) and other.wait_connected(20)
    assert wait_for(lambda: agent.mismatches == 1)
    assert other.agent_node == "worker-1" and same.agent_node == "worker-1"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # The agent names the rank, both names and what to set; so does the rank.
    assert any("rank 1 of notes" in m and "'ip-10-0-0-7'" in m and "DIAG_NODE" in m for m in said)
    assert any("this rank runs on node 'ip-10-0-0-7'" in m and "'worker-1'" in m for m in said)


@pytest.mark.timeout(60)
def test_a_fallback_to_storage_is_logged_with_what_was_held_and_counted_once(
    agent: RankNotes, clients, caplog
) -> None:
    caplog.set_level(logging.INFO)
    c0, c1 = clients(0, "worker-1"), clients(1, "worker-1")
    assert c0.wait_connected(20) and c1.wait_connected(20)
    held = "rank 0: 46, 47; rank 1: 45"
    for c in (c0, c1):  # every rank says it: one launch, one fallback
        c.resumed(ResumeNote("storage", 40, "no step in memory on every rank", True, held, "r1"))
    assert wait_for(lambda: agent.last_resume is not None and agent.fallbacks == 1)
    assert wait_for(lambda: any(held in r.getMessage() for r in caplog.records))
    (line,) = [r.getMessage() for r in caplog.records if held in r.getMessage()]
    assert "storage step 40" in line and "not from memory" in line
    # A launch that resumed from memory is no fallback.
    c0.resumed(ResumeNote("memory", 47, "newest common step", True, "ranks 0-1: 46, 47", "r2"))
    assert wait_for(lambda: agent.last_resume is not None and agent.last_resume.run == "r2")
    assert agent.fallbacks == 1


@pytest.mark.timeout(60)
def test_replication_state_reaches_the_ranks_and_saves_wake_the_pushes(
    agent: RankNotes, clients
) -> None:
    state = ReplicaState()
    saved: list[tuple[str, int, int]] = []

    def current() -> ReplicaState:
        return state

    agent.replica = current
    agent.on_saved.append(lambda job, rank, step: saved.append((job, rank, step)))
    c0 = clients(0, "worker-1")
    acks: list[ReplicaAck] = []
    c0.on_replica = acks.append
    assert c0.wait_connected(20)
    assert wait_for(lambda: acks == [ReplicaAck(True, -1, "")])
    state = ReplicaState(12, "run-a")
    assert wait_for(lambda: agent.sessions.of_job(JOB).get(0) is not None)
    agent.confirmed(JOB)
    assert wait_for(lambda: acks[-1:] == [ReplicaAck(True, 12, "run-a")])
    c0.saved(13)
    assert wait_for(lambda: saved == [(JOB, 0, 13)])
