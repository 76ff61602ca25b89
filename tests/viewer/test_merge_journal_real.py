"""`diag merge` reads the journal tails `diag dump` writes beside the dumps of real attached
ranks: the training loop runs in a worker thread (the main thread only joins it), and on the odd
rank that worker writes a checkpoint, in no collective: the journal's last op names it as the
training thread. The control channel's gRPC poller, a thread of grpc's frames only, is diag's
because the journal meta says so. Without the tails the same dumps would be read wrongly: the
main thread taken for the training thread, the poller for the job's RPC."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from diag.formats.journalmeta import journal_path, read_meta
from diag.formats.rundir import control_socket_path
from diag.viewer.merge import merge_incident

pytest.importorskip("torch")

JOB = "jrnthreads"
WORLD = 3
ODD = 1
PROGRAM = """
import os, threading, time
import torch, torch.distributed as dist
import diag.trainer

def save_checkpoint():
    time.sleep(3600)

def train():
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    print("ready", threading.get_native_id(), flush=True)
    if dist.get_rank() == ODD_RANK:
        save_checkpoint()
    else:
        dist.barrier()

dist.init_process_group("gloo")
diag.trainer.attach()
worker = threading.Thread(target=train, name="trainer-loop")
worker.start()
worker.join()
""".replace("ODD_RANK", str(ODD))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from diag.agent.checkpoint.manager import CheckpointManager
    from diag.agent.checkpoint.service import ControlServer

    # the run directory holds the control socket: keep its path short
    run_dir = Path(tempfile.mkdtemp(prefix="diag-jrn-", dir="/dev/shm"))
    prog = tmp_path_factory.mktemp("prog") / "rank.py"
    prog.write_text(PROGRAM)
    manager = CheckpointManager(run_dir, None)
    server = ControlServer(control_socket_path(run_dir, JOB), manager).start()
    port = free_port()
    procs = []
    try:
        for r in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "DIAG_RUN_DIR": str(run_dir),
                "DIAG_JOB": JOB,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(prog)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env=env,
                )
            )
        workers = {}
        for r, p in enumerate(procs):
            word, tid = p.stdout.readline().split()
            assert word == "ready"
            workers[r] = int(tid)
        # the control clients connected: each meta names the channel's poller
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metas = [read_meta(journal_path(run_dir, JOB, r)) for r in range(WORLD)]
            if all(m.own_threads for m in metas):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the control clients never recorded their gRPC thread")
        time.sleep(1.0)  # let the barrier settle
        yield run_dir, workers, {r: m.own_threads for r, m in enumerate(metas)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        server.stop()
        manager.close(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)


def diag_dump(run_dir: Path, timeline: Path) -> Path:
    args = [sys.executable, "-m", "diag.cli.main", "dump", "--run-dir", str(run_dir)]
    args += ["--timeline", str(timeline), "--job", JOB]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (incident,) = [p for p in timeline.iterdir() if p.is_dir()]
    return incident


def lines_with(folded: Path, *parts: str) -> list[str]:
    return [x for x in folded.read_text().splitlines() if all(p in x for p in parts)]


def role_of(line: str) -> str:
    return line.split(";", 1)[0].split("@")[1]


@pytest.mark.timeout(300)
def test_the_journal_names_the_training_thread_and_diag_threads(tmp_path: Path, job) -> None:
    run_dir, workers, own = job
    incident = diag_dump(run_dir, tmp_path / "timeline")
    for r in range(WORLD):
        tail = json.loads((incident / f"{r:05d}-{WORLD:05d}.journal.json").read_text())
        ops = [x for x in tail["records"] if x["kind"] == "op"]
        assert ops and ops[-1]["tid"] == workers[r], (r, ops[-1])
        assert tail["meta"]["own_threads"] == list(own[r])

    result = merge_incident(incident, out_dir=tmp_path / "out")
    assert [s.rank for s in result.suspects] == [ODD], result.suspects
    py = result.report.views[0]
    (odd,) = [c for c in py.classes if c.suspect]
    assert odd.ranks == str(ODD) and odd.thread == "Thread@trainer-loop"
    assert any("save_checkpoint" in f for f in (odd.leaf, *odd.tail)), odd
    for folded in result.folded.values():
        training = lines_with(folded, "Role@training@")
        # the worker trains on every rank; the main thread, joining it, is no training thread
        assert training and all(";Thread@trainer-loop@" in x for x in training)
        assert lines_with(folded, "Thread@MainThread@", "join")
        assert not lines_with(folded, "Role@training@", "Thread@MainThread@")
        spin = lines_with(folded, "channel_spin@")
        assert spin and {role_of(x) for x in spin} == {"diag"}

    # the same dumps without the journal tails: the stacks alone mislead on both counts
    bare = tmp_path / "bare"
    shutil.copytree(incident, bare, ignore=shutil.ignore_patterns("*.journal.json"))
    blind = merge_incident(bare, out_dir=tmp_path / "blind")
    folded = blind.folded[next(iter(blind.folded))]
    assert lines_with(folded, "Role@training@", "Thread@MainThread@", "join")
    assert {role_of(x) for x in lines_with(folded, "channel_spin@")} == {"rpc"}
