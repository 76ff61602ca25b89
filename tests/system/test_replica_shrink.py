"""A node lost, the job shrinks: two nodes on this machine (a run directory, a real `diag agent`
with `--replica-nodes` and a torchrun of one rank each, rendezvous on loopback) train a 2-rank
DeepSpeed job that persists to storage only every few steps. Node b is lost (its rank, torchrun
and agent SIGKILLed, its shared memory wiped); node a's rank fails with it, a's agent persists
its own rank's snapshots and, b's agent staying silent, the replica of b it holds, so the newest
step complete on both nodes commits. The job restarted at 1 rank resumes from that step, not the
older persisted one, through DeepSpeed's universal checkpoint, and its losses continue an
uninterrupted run's (elastic_job.py keeps the global batch at every size; tolerance as in
test_elastic_resume.py).

Long tier: four DeepSpeed ranks start (the 2-node job, the restart, the uninterrupted run), past
20 s of CPU; the default tier checks the handover with real replicators and a real checkpoint
manager (tests/agent/replica/test_handoff.py) and the universal resume through the flash
checkpoint at other sizes (test_elastic_resume.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jobrun
import psutil
import pytest
from repo import SUPPORT

from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import read_latest_step, writing_marker_path

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

JOB_SCRIPT = SUPPORT / "jobs" / "elastic_job.py"
NODES = ("node-a", "node-b")
PERSIST_EVERY = 4
RTOL = 1e-5  # test_elastic_resume.py: float32 rounding of differently grouped sums


def wait_for(pred, timeout: float, what: str, logs) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s:\n{logs()}"
        time.sleep(0.2)


class Cluster:
    def __init__(self, root: Path, zero: int) -> None:
        self.root = root
        self.zero = zero
        self.job = f"shrink-z{zero}"
        self.save = root / "ckpt" / f"z{zero}"
        self.runs = {n: Path(tempfile.mkdtemp(prefix=f"diag-shrink-{n}-", dir="/dev/shm"))
                     for n in NODES}  # fmt: skip
        ports = {n: jobrun.free_port() for n in NODES}
        self.ring = ",".join(f"{n}=127.0.0.1:{ports[n]}" for n in NODES)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.trainers: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, node: str) -> dict[str, str]:
        return dict(os.environ, DIAG_RUN_DIR=str(self.runs[node]), DIAG_NODE=node,
                    DIAG_REPLICA_TOKEN="job-secret-replica-token", OMP_NUM_THREADS="1")  # fmt: skip

    def start_agent(self, node: str) -> None:
        log = open(self.root / f"agent-{node}.log", "ab")  # noqa: SIM115 - the agent owns it
        self.agents[node] = subprocess.Popen(
            [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(self.runs[node]),
             "--timeline", str(self.root / f"timeline-{node}"), "--job", self.job, "--node", node,
             "--replica-nodes", self.ring, "--replica-listen", "127.0.0.1",
             "--replica-interval", "0.2", "--replica-lost-after", "1", "--native-stacks", "false",
             "--interval", "0.25", "-v", "--replica-dir", str(self.runs[node] / ".replicas")],
            env=self.env(node), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()

    def job_args(self, out: str, steps: int, *extra: str) -> list[str]:
        return [str(JOB_SCRIPT), "--zero", str(self.zero), "--job-prefix", "shrink",
                "--save-dir", str(self.root / "ckpt"), "--out", str(self.root / out),
                "--steps", str(steps), *extra]  # fmt: skip

    def start_trainer(self, node: str, master_port: int) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
               str(NODES.index(node)), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(master_port), "--max-restarts", "0",
               *self.job_args("two-nodes", 10_000, "--persist-every", str(PERSIST_EVERY),
                              "--step-sleep", "1.0")]  # fmt: skip
        self.trainers[node] = jobrun.start(cmd, self.root / f"trainer-{node}.log", self.env(node))

    def lose(self, node: str) -> None:
        """The node is gone: its torchrun, rank and agent killed at once, its memory wiped."""
        procs = []
        for p in (self.trainers.pop(node), self.agents.pop(node)):
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(p.pid)
                procs += [root, *root.children(recursive=True)]
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=30)
        shutil.rmtree(self.runs[node], ignore_errors=True)

    def held(self, holder: str, node: str) -> list[int]:
        d = self.runs[holder] / ".replicas"
        with contextlib.suppress(OSError):
            return sorted(int(p.name.split("-")[-2]) for p in d.glob(f"{node}-*-*")
                          if (p / "replica.json").exists())  # fmt: skip
        return []

    def logs(self) -> str:
        out = []
        for name in (*(f"agent-{n}" for n in NODES), *(f"trainer-{n}" for n in NODES), "shrunk"):
            with contextlib.suppress(OSError):
                text = (self.root / f"{name}.log").read_text(errors="replace")
                out.append(f"--- {name}\n{text[-2500:]}")
        return "\n".join(out)

    def close(self) -> None:
        for p in self.trainers.values():
            jobrun.stop(p)
        for p in self.agents.values():
            p.send_signal(signal.SIGTERM)
        for p in self.agents.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for d in self.runs.values():
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cluster(request):  # type: ignore[no-untyped-def]
    root = Path(tempfile.mkdtemp(prefix="diag-test-shrink-"))
    c = Cluster(root, request.param)
    try:
        yield c
    finally:
        c.close()
        shutil.rmtree(root, ignore_errors=True)


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("cluster", [1, 2, 3], indirect=True, ids=["zero1", "zero2", "zero3"])
def test_a_lost_node_s_replica_lets_the_shrunk_job_resume_from_the_newest_step(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster
    for node in NODES:
        c.start_agent(node)
    for node in NODES:
        wait_for(control_socket_path(c.runs[node], c.job).exists, 60, f"{node}'s agent", c.logs)
    port = jobrun.free_port()
    for node in NODES:
        c.start_trainer(node, port)

    # a step persisted, then a newer one of b held by a only in memory
    wait_for(lambda: (read_latest_step(c.save) or 0) >= PERSIST_EVERY, 300,
             f"step {PERSIST_EVERY} committed", c.logs)  # fmt: skip
    wait_for(lambda: any(s > (read_latest_step(c.save) or 0) and s % PERSIST_EVERY
                         for s in c.held("node-a", "node-b")), 120,
             "node-a holds a newer step of node-b than storage", c.logs)  # fmt: skip

    c.lose("node-b")
    [held] = c.held("node-a", "node-b")  # the replica a holds now, for good
    older = read_latest_step(c.save)
    assert older is not None and older < held
    # node a's rank fails with its peer (or is stopped); its torchrun gives up (no restarts)
    assert jobrun.finish(c.trainers.pop("node-a"), timeout=300) != 0, c.logs()
    # node a's agent marks that it writes the newest step (its ranks' own parts, then b's
    # replica once b stayed silent): the restart goes at once, and its rank waits for the mark
    mark = writing_marker_path(c.runs["node-a"], c.job)
    wait_for(lambda: mark.exists() or read_latest_step(c.save) == held, 120,
             "node-a's agent writing the newest step", c.logs)  # fmt: skip

    # the job restarts without node b, at 1 rank: from that step, through the universal checkpoint
    upto = held + 3
    rc = jobrun.run(jobrun.command(1, *c.job_args("shrunk", upto)), c.root / "shrunk.log",
                    c.env("node-a"))  # fmt: skip
    assert rc == 0, c.logs()
    agent_log = (c.root / "agent-node-a.log").read_text(errors="replace")
    assert "node-b is lost" in agent_log and f"replica of step {held}" in agent_log, agent_log
    start = json.loads((c.root / "shrunk" / f"z{c.zero}" / "start.json").read_text())
    assert (start["step"], start["from"], start["resharded_from"]) == (held, "storage", 2), start

    # the losses continue an uninterrupted run's
    base_args = c.job_args("base", upto, "--no-flash")
    rc = jobrun.run(jobrun.command(1, *base_args), c.root / "base.log", c.env("node-a"))
    assert rc == 0, (c.root / "base.log").read_text(errors="replace")[-3000:]
    base = losses(c.root / "base" / f"z{c.zero}" / "loss.jsonl")
    before = losses(c.root / "two-nodes" / f"z{c.zero}" / "loss.jsonl")
    after = losses(c.root / "shrunk" / f"z{c.zero}" / "loss.jsonl")
    assert sorted(after) == list(range(held + 1, upto + 1))
    for step, loss in [*before.items(), *after.items()]:
        assert math.isclose(loss, base[step], rel_tol=RTOL), (step, loss, base[step])
