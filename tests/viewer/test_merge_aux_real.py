"""`diag merge` on dumps that `diag dump` takes from real training-like processes with helper
threads: a gloo process group whose ranks wait in a barrier (one rank stuck loading a
checkpoint instead), a DataLoader with worker processes and `pin_memory=True` (without an
accelerator torch starts no pin-memory thread, only the queue feeders; the generated dumps cover
that role), and a logging queue listener thread. Ranks differ in their helpers (one more loader worker, so one more queue
feeder; thread counters shifted by an extra thread started first): those differences must make
no suspect; the odd rank must, and a rank without a dump leads when the others agree."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from polling import idle_for

from diag.viewer.merge import merge_incident
from diag.viewer.roles import Role

pytest.importorskip("torch")

WORLD = 5  # rank 4 is started but never dumped: it did not answer
ODD = 2
DUMPED = 4
PROGRAM = """
import logging, logging.handlers, os, queue, sys, threading, time
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

class Numbers(Dataset):
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.tensor([i])

def load_checkpoint():
    time.sleep(3600)

def main():
    rank = int(os.environ["RANK"])
    if rank == 1:  # one more helper started first: every Thread-N of this rank shifts
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    listener = logging.handlers.QueueListener(queue.Queue(), logging.StreamHandler())
    listener.start()
    workers = 3 if rank == 3 else 2
    loader = DataLoader(Numbers(), batch_size=2, num_workers=workers, pin_memory=True)
    it = iter(loader)
    next(it)
    dist.init_process_group("gloo")
    print("ready", flush=True)
    if rank == ODD_RANK:
        load_checkpoint()
    else:
        dist.barrier()

main()
""".replace("ODD_RANK", str(ODD))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    prog = tmp_path_factory.mktemp("prog") / "rank.py"
    prog.write_text(PROGRAM)
    port = free_port()
    procs = []
    try:
        for r in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
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
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        # The loader's workers fill their prefetch queue after "ready": until every rank is idle
        # (its process tree's CPU time stops growing), a dump may catch a thread mid-batch.
        assert wait_idle(procs, timeout=120), "the ranks did not settle"
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def wait_idle(procs: list[subprocess.Popen], timeout: float) -> bool:
    """True once the processes and their children are idle in two 1 s windows in a row."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        quiet = quiet + 1 if idle_for([p.pid for p in procs]) else 0
        if quiet >= 2:
            return True
    return False


def diag_dump(timeline: Path, pids: list[int]) -> Path:
    args = [sys.executable, "-m", "diag.cli.main", "dump", "--timeline", str(timeline)]
    for pid in pids:
        args += ["--pid", str(pid)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (incident,) = [p for p in timeline.iterdir() if p.is_dir()]
    return incident


@pytest.mark.timeout(300)
def test_real_dumps_with_helper_threads(tmp_path: Path, ranks) -> None:
    pids = [p.pid for p in ranks[:DUMPED]]
    incident = diag_dump(tmp_path / "timeline", pids)
    dumps = sorted(incident.glob("*.stack.json"))
    assert len(dumps) == DUMPED
    names = {t["name"] for d in dumps for t in json.loads(d.read_text())["threads"]}
    assert "QueueFeederThread" in names
    assert any("_monitor" in n for n in names), names  # the logging listener

    result = merge_incident(incident, out_dir=tmp_path / "out")
    # the odd rank leads; the rank that did not answer follows; helpers set nobody apart
    assert [s.rank for s in result.suspects] == [ODD, DUMPED], result.suspects
    py = result.report.views[0]
    assert len(py.classes) == 2
    folded = result.folded[next(iter(result.folded))].read_text()
    for role in (Role.TRAINING, Role.QUEUE_FEEDER, Role.LOGGING):
        assert f"Role@{role.value}@" in folded
    assert "Thread@Thread-N (_monitor)" in folded  # counters folded: Thread-1 and Thread-2 merge
    assert "State@no dump: rank did not answer" in folded


@pytest.mark.timeout(300)
def test_when_answering_ranks_agree_the_silent_rank_leads(tmp_path: Path, ranks) -> None:
    pids = [p.pid for i, p in enumerate(ranks[:DUMPED]) if i != ODD]
    incident = diag_dump(tmp_path / "timeline", pids)
    # `diag dump --pid` takes ranks from the processes' environment; rank 2 and 4 are silent
    result = merge_incident(incident, out_dir=tmp_path / "out")
    # the two silent ranks are the suspects, and nothing else: the helpers' differences and
    # the timing of the waiting ranks' native leaves set nobody apart
    assert [(s.rank, s.score) for s in result.suspects] == [(ODD, 1.0), (DUMPED, 1.0)], (
        result.suspects
    )
    for view in result.report.views:
        assert len(view.classes) == 1, (view.view, [c.ranks for c in view.classes])
