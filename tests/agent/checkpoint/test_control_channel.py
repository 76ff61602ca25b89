"""The control channel with a real gRPC server on a unix socket and the trainer's real client:
registration, status, commands and reports, persist requests and acknowledgements, a late agent,
an agent restart."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from polling import wait_for
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.service import ControlServer
from diag.agent.checkpoint.sessions import CommandKind
from diag.formats.rundir import control_socket_path
from diag.formats.stackdump import RankDump
from diag.proto import control_pb2 as pb
from diag.proto import control_pb2_grpc as pb_grpc
from diag.trainer.control.client import ControlClient
from diag.trainer.control.identity import ClientIdentity

JOB = "ctl"


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-ctl-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Agent:
    """The agent's checkpoint side alone: manager + gRPC server."""

    def __init__(self, run_dir: Path) -> None:
        self.manager = CheckpointManager(run_dir, None)
        self.server = ControlServer(control_socket_path(run_dir, JOB), self.manager).start()

    def stop(self) -> None:
        self.server.stop()
        self.manager.close(timeout=10)


@pytest.fixture
def agents(run_dir: Path):
    started: list[Agent] = []

    def start() -> Agent:
        a = Agent(run_dir)
        started.append(a)
        return a

    try:
        yield start
    finally:
        for a in started:
            a.stop()


@pytest.fixture
def clients(run_dir: Path):
    made: list[ControlClient] = []

    def make(rank: int = 0) -> ControlClient:
        ident = ClientIdentity(JOB, rank, 2, rank, 0, "node-a", os.getpid() + rank)
        c = ControlClient(run_dir, ident, journal=f"/j{rank}").start()
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.mark.timeout(60)
def test_register_status_and_commands(run_dir: Path, agents, clients, tmp_path: Path) -> None:
    agent = agents()
    c0, c1 = clients(0), clients(1)
    got: list[pb.Command] = []
    c1.on_command = got.append
    assert wait_for(lambda: agent.manager.connected(JOB) == [0, 1])
    assert c0.agent_pid == os.getpid()

    with grpc.insecure_channel(f"unix:{agent.server.path}") as ch:
        status = pb_grpc.ControlStub(ch).Status(pb.StatusRequest(job=JOB), timeout=5)
    assert [(r.rank, r.connected, r.memory_step) for r in status.ranks] == [
        (0, True, -1),
        (1, True, -1),
    ]

    sent = agent.manager.send_command(JOB, CommandKind.FLUSH, [1], reason="test")
    assert list(sent) == [1]
    assert wait_for(lambda: len(got) == 1)
    assert got[0].kind == pb.COMMAND_KIND_FLUSH and got[0].reason == "test"
    c1.report(got[0].id, True, step=12)
    reports = agent.manager.wait_reports([sent[1]], timeout=10)
    assert reports[sent[1]].ok and reports[sent[1]].step == 12

    # DUMP is answered by the client itself: this process's stacks, in our dump format.
    dumps = agent.manager.send_command(JOB, CommandKind.DUMP, dump_dir=str(run_dir / "incident"))
    reports = agent.manager.wait_reports(list(dumps.values()), timeout=10)
    assert sorted(r.rank for r in reports.values()) == [0, 1]
    for r in reports.values():
        assert r.ok, r.detail
        dump = RankDump.load(Path(r.path))
        assert dump.rank == r.rank and dump.world_size == 2
        funcs = {f.func for t in dump.threads for f in t.frames}
        assert "test_register_status_and_commands" in funcs, "the test's own frame is there"


@pytest.mark.timeout(60)
def test_persist_request_and_acknowledgement(run_dir: Path, agents, clients, tmp_path) -> None:
    agent = agents()
    client = clients(0)
    acks: list[pb.PersistAck] = []
    client.on_ack = acks.append
    assert client.wait_connected(20)
    slot = new_slot(run_dir, JOB, 0, 0, world=1)
    files = captured({"global_step7/mp_rank_00_model_states.pt": model_states(7)})
    write_snapshot(slot, 7, files, job=JOB, rank=0, world=1, save_dir=tmp_path)
    slot.close()
    client.persist(7, str(tmp_path))
    # A request made while the new connection's resend of pending steps is on its way may go
    # twice (persisting a step again is harmless): an acknowledgement of step 7 is what counts.
    assert wait_for(lambda: len(acks) >= 1)
    assert acks[0].ok and acks[0].committed and acks[0].step == 7 and acks[0].bytes > 0
    assert client.persist_pending() == []
    assert (tmp_path / "latest").read_text() == "global_step7"
    client.persist(8, str(tmp_path))  # not in memory: refused with a reason, never blocks
    assert wait_for(lambda: any(a.step == 8 for a in acks))
    (refused,) = [a for a in acks if a.step == 8]
    assert not refused.ok and "not in memory" in refused.error
    assert all(a.ok for a in acks if a.step == 7)
    (stats,) = agent.manager.stats().ranks
    # The last persist may be that second request's, which finds step 7 written already.
    assert stats.persisted_step == 7 and stats.memory_step == 7


@pytest.mark.timeout(60)
def test_late_agent_and_agent_restart(run_dir: Path, agents, clients, tmp_path, caplog) -> None:
    client = clients(0)
    acks: list[pb.PersistAck] = []
    client.on_ack = acks.append
    client.persist(3, str(tmp_path))  # no agent yet: returns at once, stays pending
    assert client.persist_pending() == [3] and not client.connected
    assert wait_for(lambda: "no diag agent socket" in caplog.text, 10)

    first = agents()
    assert client.wait_connected(20), "a late agent is found"
    assert wait_for(lambda: len(acks) == 1), "the pending request was sent after connecting"
    assert not acks[0].ok  # step 3 was never in memory

    first.stop()
    assert wait_for(lambda: not client.connected)
    second = agents()
    assert wait_for(lambda: client.connected and client.connects == 2)
    assert wait_for(lambda: second.manager.connected(JOB) == [0])
    sent = second.manager.send_command(JOB, CommandKind.DUMP, dump_dir=str(run_dir / "d"))
    assert second.manager.wait_reports(list(sent.values()), timeout=10)


def test_stale_socket_is_replaced_and_a_live_agent_is_not(run_dir: Path, agents) -> None:
    path = control_socket_path(run_dir, JOB)
    path.write_text("")  # left by an agent that died
    agent = agents()
    assert agent.server.path == path
    from diag.formats.exitcodes import UsageError

    with pytest.raises(UsageError, match="another agent"):
        agents()


def test_command_to_a_rank_that_never_listened_is_not_sent(run_dir: Path, agents) -> None:
    agent = agents()
    from diag.agent.checkpoint.sessions import RankKey

    agent.manager.sessions.register(RankKey(JOB, 0), 1234)  # registered, no stream
    assert agent.manager.send_command(JOB, CommandKind.EXIT) == {}
    assert json.dumps(agent.manager.wait_reports([], 0.1)) == "{}"


@pytest.mark.timeout(60)
def test_recover_is_taken_by_a_rank_that_recovers_and_stops_the_rest(
    run_dir: Path, agents, clients
) -> None:
    """--on-hang recover's exchange over the real channel: RECOVER reaches the rank's recovery
    with the verdict's reason and time; without a recovery the rank says so and is stopped."""
    from diag.agent.loop.inplace import ask_to_recover
    from diag.trainer.control import immediate

    agent = agents()
    clients(0), clients(1)
    assert wait_for(lambda: agent.manager.connected(JOB) == [0, 1])
    heard: list[tuple[str, float]] = []

    def recovery(reason: str, verdict_time: float) -> immediate.RecoverAnswer:
        heard.append((reason, verdict_time))
        return immediate.RecoverAnswer(True, "recovering in place from generation 0")

    immediate.recover_with(recovery)
    try:
        out = ask_to_recover(agent.manager, JOB, (0, 1, 2), "hang: rank 1\x1b[2J", 1234.5, 10)
    finally:
        immediate.recover_with(None)
    assert out.taken == (0, 1) and out.to_stop == ()  # rank 2 is not connected: not asked
    assert dict(out.answers)[2].startswith("not connected")
    # Each client took it (both live in this process); the terminal escape was dropped.
    assert heard == [("the agent's verdict: hang: rank 1", 1234.5)] * 2

    out = ask_to_recover(agent.manager, JOB, (0, 1), "hang", 0.0, 10)
    assert out.taken == () and out.to_stop == (0, 1), "nobody recovers: every rank is stopped"
    assert all(immediate.NOT_RESILIENT in said for _, said in out.answers)


def test_ranks_that_cannot_recover_or_stay_silent_are_stopped() -> None:
    from diag.agent.checkpoint.sessions import CommandReport
    from diag.agent.loop.inplace import judge

    sent = {0: "c1", 1: "c2", 2: "c3"}
    reports = {
        "c1": CommandReport("c1", 0, True, "recovering"),
        "c3": CommandReport("c3", 2, False, "not under it"),
    }
    out = judge((0, 1, 2, 3), sent, reports)
    assert out.taken == (0,) and out.to_stop == (1, 2), "silent (1) and refusing (2) are stopped"
    assert "no answer" in dict(out.answers)[1] and dict(out.answers)[3].startswith("not connected")
    assert out.not_asked == (3,)
    assert judge((0, 1), {0: "c1"}, {}).to_stop == (0, 1), "nobody took it: all stopped"
