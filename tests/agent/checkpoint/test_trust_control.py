"""Who the trainer talks to on its control socket, and what it does with what it hears.

Real sockets, real processes: an impostor serving the socket as another user (`nobody`), a
symlink put where the agent's socket should be, the real agent sending DUMP commands that name
directories outside the rank's bases, an agent sending values out of range."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from polling import wait_for
from repo import SUPPORT

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.service import ControlServer
from diag.agent.checkpoint.sessions import CommandKind
from diag.formats.rundir import control_socket_path
from diag.proto import control_pb2 as pb
from diag.proto import control_pb2_grpc as pb_grpc
from diag.trainer.control.client import ControlClient
from diag.trainer.control.identity import ClientIdentity
from diag.trainer.control.peer import PeerConfigError, parse_uid

JOB = "trust"
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


@pytest.fixture
def shm_dir() -> Iterator[Callable[[str], Path]]:
    made: list[Path] = []

    def make(prefix: str) -> Path:
        d = Path(tempfile.mkdtemp(prefix=f"diag-test-{prefix}-", dir="/dev/shm"))
        made.append(d)
        return d

    try:
        yield make
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def run_dir(shm_dir) -> Path:
    return shm_dir("trust")


@pytest.fixture
def clients(monkeypatch) -> Iterator[Callable[..., ControlClient]]:
    made: list[ControlClient] = []
    monkeypatch.delenv("DIAG_AGENT_UID", raising=False)
    monkeypatch.delenv("DIAG_CONTROL_SOCKET", raising=False)

    def make(run_dir: Path, socket_path: Path | None = None) -> ControlClient:
        ident = ClientIdentity(JOB, 0, 1, 0, 0, "node-a", os.getpid())
        c = ControlClient(run_dir, ident, socket_path=socket_path).start()
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


class Impostor:
    """tests/support/peers/fake_control_agent.py as user `nobody`, serving `socket`."""

    def __init__(self, socket: Path, dump_dir: Path) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(SUPPORT / "peers" / "fake_control_agent.py"), str(socket),
             "--uid", str(NOBODY), "--dump-dir", str(dump_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert wait_for(lambda: "ready" in self.lines, 30), "the impostor did not start"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def impostor(shm_dir) -> Iterator[Callable[[Path], tuple[Impostor, Path]]]:
    started: list[Impostor] = []

    def start(dump_dir: Path) -> tuple[Impostor, Path]:
        home = shm_dir("impostor")
        os.chown(home, NOBODY, NOBODY)  # a directory `nobody` can bind a socket in
        socket = home / "agent.sock"
        imp = Impostor(socket, dump_dir)
        started.append(imp)
        return imp, socket

    try:
        yield start
    finally:
        for imp in started:
            imp.stop()


@needs_root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("socket_owner", ["nobody", "root"])
def test_an_agent_served_by_another_user_is_not_obeyed(
    run_dir: Path, clients, impostor, caplog, socket_owner: str
) -> None:
    """`nobody` serves the socket; its file is left to `nobody` or chowned to root (so only
    the listener's SO_PEERCRED can tell). The rank sends it nothing and obeys nothing."""
    caplog.set_level(logging.WARNING, logger="diag.trainer.control.client")
    fake, socket = impostor(run_dir / "evil")
    if socket_owner == "root":
        os.chown(socket, 0, 0)
    client = clients(run_dir, socket)
    got: list[object] = []
    client.on_command = got.append
    acks: list[object] = []
    client.on_ack = acks.append

    assert wait_for(lambda: "not talking to the control socket" in caplog.text or got)
    time.sleep(1.0)  # what an obedient client would have done by now, it would have done
    assert got == [] and acks == [] and not client.connected and client.agent_pid is None
    assert fake.lines == ["ready"], "the rank said nothing to it, not even Register"
    assert str(socket) in caplog.text and f"uid {NOBODY}" in caplog.text
    if socket_owner == "root":
        assert "served by uid 65534" in caplog.text and f"pid {fake.proc.pid}" in caplog.text
    else:
        assert "owned by uid 65534" in caplog.text
    assert not (run_dir / "evil").exists(), "no DUMP was carried out"
    warnings = [r for r in caplog.records if "not talking" in r.getMessage()]
    assert len(warnings) == 1, "one warning, not one per retry"


@needs_root
@pytest.mark.timeout(60)
def test_the_configured_agent_user_is_trusted(run_dir: Path, clients, impostor, monkeypatch):
    """DIAG_AGENT_UID names an agent that runs as yet another user: then it is obeyed."""
    fake, socket = impostor(run_dir / "incident")
    monkeypatch.setenv("DIAG_AGENT_UID", str(NOBODY))
    client = clients(run_dir, socket)
    got: list[object] = []
    client.on_command = got.append
    assert wait_for(lambda: len(got) == 2), fake.lines
    assert client.peer is not None and client.peer.uid == NOBODY
    assert client.peer.pid == fake.proc.pid
    assert wait_for(lambda: "report x2 True" in fake.lines), fake.lines  # DUMP went through


@pytest.mark.timeout(60)
def test_a_symlink_in_place_of_the_socket_is_refused(
    run_dir: Path, shm_dir, clients, caplog
) -> None:
    """A trusted agent's socket elsewhere, reached through a symlink at the rank's socket path:
    whoever made the link chose where the rank connects, so the rank does not."""
    caplog.set_level(logging.WARNING, logger="diag.trainer.control.client")
    elsewhere = shm_dir("elsewhere")
    manager = CheckpointManager(elsewhere, None)
    server = ControlServer(control_socket_path(elsewhere, JOB), manager).start()
    try:
        link = control_socket_path(run_dir, JOB)
        link.symlink_to(server.path)
        client = clients(run_dir)
        assert wait_for(lambda: "is a symlink" in caplog.text or client.connected)
        time.sleep(0.5)
        assert not client.connected and manager.connected(JOB) == []
        assert str(link) in caplog.text
    finally:
        server.stop()
        manager.close(timeout=10)


@pytest.fixture
def agent(run_dir: Path) -> Iterator[CheckpointManager]:
    manager = CheckpointManager(run_dir, None)
    server = ControlServer(control_socket_path(run_dir, JOB), manager).start()
    try:
        yield manager
    finally:
        server.stop()
        manager.close(timeout=10)


@pytest.mark.timeout(60)
def test_dump_writes_only_beneath_the_ranks_bases(
    run_dir: Path, shm_dir, agent: CheckpointManager, clients, monkeypatch
) -> None:
    outside = shm_dir("outside")
    monkeypatch.setenv("DIAG_TIMELINE", str(run_dir / "timeline"))
    (run_dir / "planted").symlink_to(outside)
    client = clients(run_dir)
    assert client.wait_connected(20) and wait_for(lambda: agent.connected(JOB) == [0])

    def dump(directory: str):
        (cid,) = agent.send_command(JOB, CommandKind.DUMP, dump_dir=directory).values()
        return agent.wait_reports([cid], timeout=10)[cid]

    for bad in (
        str(outside),
        str(outside / "x"),
        "../x",
        "x",
        f"{run_dir}/../{outside.name}",
        f"{run_dir}/planted",
        f"{run_dir}/planted/deeper",
        f"{run_dir}/./x",
        f"{run_dir}//x",
    ):
        report = dump(bad)
        assert not report.ok and "refused" in report.detail, (bad, report)
    assert list(outside.iterdir()) == [], "nothing was written outside the bases"
    assert not (run_dir.parent / "x").exists()

    for good in (run_dir / "incident" / "n1", run_dir / "timeline" / "i2"):
        report = dump(str(good))
        assert report.ok, report.detail
        path = Path(report.path)
        assert path.parent == good and path.is_file()
        assert path.stat().st_mode & 0o777 == 0o600


class Scripted(pb_grpc.ControlServicer):
    """A trusted agent (this process) that sends a fixed list of messages."""

    def __init__(self, messages: list[pb.AgentMessage]) -> None:
        self.messages = messages
        self.reports: list[pb.CommandReport] = []

    def Register(self, request, context):
        return pb.RegisterReply(agent_pid=os.getpid(), agent_version="scripted")

    def Subscribe(self, request, context):
        yield from self.messages
        while context.is_active():
            time.sleep(0.05)

    def Report(self, request, context):
        self.reports.append(request)
        return pb.ReportReply()


@pytest.mark.timeout(60)
def test_values_out_of_range_are_not_acted_on(run_dir: Path, clients) -> None:
    def cmd(cid: str, kind: int, **kw) -> pb.AgentMessage:
        return pb.AgentMessage(command=pb.Command(id=cid, kind=kind, **kw))

    def ack(**kw) -> pb.AgentMessage:
        return pb.AgentMessage(persist_ack=pb.PersistAck(**kw))

    script = Scripted([
        cmd("big-exit", pb.COMMAND_KIND_EXIT, exit_code=999),
        cmd("neg-exit", pb.COMMAND_KIND_EXIT, exit_code=-1),
        cmd("odd-kind", 7),
        cmd("no-kind", pb.COMMAND_KIND_UNSPECIFIED),
        cmd("long-reason", pb.COMMAND_KIND_FLUSH, reason="r" * 100_000),
        cmd("bad\x1b[2Jid", pb.COMMAND_KIND_FLUSH),
        cmd("nan-time", pb.COMMAND_KIND_RECOVER, verdict_time=float("nan")),
        cmd("neg-time", pb.COMMAND_KIND_RECOVER, verdict_time=-1.0),
        ack(step=-5, ok=True),
        ack(step=3, ok=True, bytes=-1),
        ack(step=4, ok=True, seconds=float("nan")),
        cmd("fine", pb.COMMAND_KIND_EXIT, exit_code=143, reason="ok\x1b]0;title\x07"),
        ack(step=9, ok=True, bytes=10, seconds=0.5),
    ])  # fmt: skip
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ControlServicer_to_server(script, server)
    socket = run_dir / "scripted.sock"
    assert server.add_insecure_port(f"unix:{socket}")
    server.start()
    try:
        client = clients(run_dir, socket)
        got: list = []
        acks: list = []
        client.on_command = got.append
        client.on_ack = acks.append
        assert wait_for(lambda: len(got) == 1 and len(acks) == 1)
        assert wait_for(lambda: len(script.reports) == 7)
        time.sleep(0.3)
        assert [(c.id, c.exit_code, c.reason) for c in got] == [("fine", 143, "ok")]
        assert [(a.step, a.bytes) for a in acks] == [(9, 10)]
        refused = {r.command_id: r.detail for r in script.reports}
        assert sorted(refused) == [
            "big-exit", "long-reason", "nan-time", "neg-exit", "neg-time", "no-kind", "odd-kind",
        ]  # fmt: skip
        assert all(not r.ok and "refused" in r.detail for r in script.reports)
        assert "exit code" in refused["big-exit"] and "kind 7" in refused["odd-kind"]
        assert "not a time" in refused["nan-time"] and "not a time" in refused["neg-time"]
    finally:
        server.stop(0)


@pytest.mark.parametrize("raw", ["12x", "-1", "+5", "1_000", "4294967295", "", "٣"])
def test_a_bad_agent_uid_is_a_clear_error(raw: str, run_dir: Path, monkeypatch) -> None:
    if not raw:
        assert parse_uid("  1000 ") == 1000
        return
    with pytest.raises(PeerConfigError, match=r"DIAG_AGENT_UID=.* is not a user id"):
        parse_uid(raw)
    monkeypatch.setenv("DIAG_AGENT_UID", raw)
    with pytest.raises(PeerConfigError, match="DIAG_AGENT_UID"):
        ControlClient(run_dir, ClientIdentity(JOB, 0, 1, 0, 0, "n", os.getpid()))


@needs_root
@pytest.mark.timeout(60)
def test_the_agent_replaces_a_socket_served_by_another_user(
    run_dir: Path, impostor, clients, caplog
) -> None:
    """A socket served by `nobody` where the agent's goes: the agent takes the path over (it
    used to refuse to start, "another agent already serves"), and the ranks find the agent."""
    fake, socket = impostor(run_dir / "evil")
    path = control_socket_path(run_dir, JOB)
    os.rename(socket, path)  # the same listening inode, now at the agent's path
    manager = CheckpointManager(run_dir, None)
    server = ControlServer(path, manager).start()
    try:
        assert f"pid {fake.proc.pid} of uid {NOBODY} listened there" in caplog.text
        client = clients(run_dir)
        assert client.wait_connected(20) and client.agent_pid == os.getpid()
        assert fake.lines == ["ready"]
    finally:
        server.stop()
        manager.close(timeout=10)


def _exchange(a: Path, b: Path) -> None:
    """renameat2(RENAME_EXCHANGE): what a trainer watching its run directory does to a
    directory the agent just made there."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
        raise OSError(ctypes.get_errno(), f"renameat2 {a} {b}")


def test_a_swapped_private_directory_changes_no_other_file(
    run_dir: Path, shm_dir, clients, monkeypatch
) -> None:
    """Finding A0: as the agent bound its socket in its private `.c*` directory, the trainer
    swapped that directory for one of its own holding `s` -> a root file; the agent's chmod
    (and chown) by path followed the link. Here the swap happens at the agent's chmod, the
    moment the trainer won the race; the root file keeps its mode, and the ranks reach the
    agent."""
    victim_dir = shm_dir("victim")
    victim = victim_dir / "root-file"
    victim.write_text("root's")
    victim.chmod(0o644)
    trap = run_dir / "trap"
    trap.mkdir()
    (trap / "s").symlink_to(victim)
    real_chmod = os.chmod
    swapped: list[Path] = []

    def chmod_after_the_swap(path, mode, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not swapped:
            private = next(p for p in run_dir.iterdir() if p.name.startswith(".c"))
            _exchange(private, trap)
            swapped.append(private)
        return real_chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", chmod_after_the_swap)
    manager = CheckpointManager(run_dir, None)
    path = control_socket_path(run_dir, JOB)
    server = ControlServer(path, manager).start()
    monkeypatch.setattr(os, "chmod", real_chmod)
    try:
        assert swapped, "the race was not run: no chmod during start-up"
        st = os.stat(victim)
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o644, 0), "the root file was changed"
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        client = clients(run_dir)
        assert client.wait_connected(20) and client.agent_pid == os.getpid()
    finally:
        server.stop()
        manager.close(timeout=10)


def _agent_process(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir), "--job", JOB,
         "--timeline", str(run_dir / "timeline"), "--interval", "0.2",
         "--drain", "false", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_a_trainer_listening_first_does_not_keep_the_agent_out(run_dir: Path, clients) -> None:
    """Finding A12: a process of the trainer's user listening at the agent's socket before the
    agent starts made it exit 2 ("another agent"). The agent holds the run directory's lock, so
    whatever listens there is not an agent: it takes the path over and the ranks reach it. A
    second agent on the same run directory still exits 2."""
    path = control_socket_path(run_dir, JOB)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(str(path))
    squatter.listen(8)
    planted = os.stat(path).st_ino
    agent = _agent_process(run_dir)
    second = None
    try:
        assert wait_for(lambda: agent.poll() is not None or _replaced(path, planted), 60)
        assert agent.poll() is None, agent.communicate()[0]
        client = clients(run_dir)
        assert client.wait_connected(20) and client.agent_pid == agent.pid
        second = _agent_process(run_dir)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2, out
        assert "another agent already serves the run directory" in out, out
    finally:
        squatter.close()
        for p in (agent, second):
            if p is not None and p.poll() is None:
                p.terminate()
        out, _ = agent.communicate(timeout=30)
    assert "listened there, which is not an agent of this run directory" in out, out


def _replaced(path: Path, inode: int) -> bool:
    try:
        return os.stat(path).st_ino != inode
    except FileNotFoundError:
        return False
