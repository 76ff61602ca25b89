"""What ran is readable by the pod's user only: op journals, their metadata and the control
socket are owner-only, whatever the umask the trainer or the agent runs with."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import grpc
import pytest

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.service import ControlServer
from diag.formats.journalmeta import GroupInfo, JournalMeta, meta_path_for, write_meta
from diag.formats.journalwriter import JournalWriter
from diag.formats.rundir import control_socket_path
from diag.proto import control_pb2 as pb
from diag.proto import control_pb2_grpc as pb_grpc


@pytest.fixture
def loose_umask():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-modes-", dir="/dev/shm"))
    os.chmod(d, 0o777)  # an emptyDir is created world-writable
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_journal_and_meta_are_owner_only(run_dir, loose_umask):
    journal = run_dir / "job-rank00000.journal"
    w = JournalWriter(journal, rank=0, world_size=1, local_rank=0)
    try:
        meta = JournalMeta(
            job="job", rank=0, world_size=1, local_rank=0, local_world_size=1,
            pid=os.getpid(), pid_start_time=0.0, node="n", groups=(GroupInfo(0, "default", (0,)),),
        )  # fmt: skip
        write_meta(journal, meta)
        assert mode(journal) == 0o600
        assert mode(meta_path_for(journal)) == 0o600
    finally:
        w.close()


def test_control_socket_is_owner_only_and_serves(run_dir, loose_umask):
    manager = CheckpointManager(run_dir, None)
    path = control_socket_path(run_dir, "job")
    server = ControlServer(path, manager).start()
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert mode(path) == 0o600
        assert [p.name for p in run_dir.iterdir()] == [path.name]  # no private dir left
        with grpc.insecure_channel(f"unix:{path}") as channel:
            reply = pb_grpc.ControlStub(channel).Status(pb.StatusRequest(job="job"), timeout=10)
        assert reply.committed_step == -1
    finally:
        server.stop()
        manager.close(timeout=10)
    assert not path.exists()
