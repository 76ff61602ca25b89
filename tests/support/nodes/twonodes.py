"""Two nodes of one job on this machine, for whole-node losses (tests/system/test_node_loss.py,
bench/node_loss_bench.py): a run directory each, a real `diag agent` with `--replica-nodes` and a
torchrun of one ZeRO-2 rank each (tests/support/jobs/elastic_job.py), rendezvous on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jobrun
import psutil
from repo import SUPPORT

from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import read_latest_step

JOB_SCRIPT = SUPPORT / "jobs" / "elastic_job.py"
NODES = ("node-a", "node-b")
PERSIST_EVERY = 20
STEP_SLEEP = 0.2


def wait_for(
    pred: Callable[[], object], timeout: float, what: str, logs: Callable[[], str]
) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s:\n{logs()}"
        time.sleep(0.05)


class TwoNodes:
    def __init__(
        self, root: Path, agent_args: tuple[str, ...] = (), job_args: tuple[str, ...] = ()
    ) -> None:
        self.root = root
        self.agent_args = agent_args  # more `diag agent` flags, e.g. --replica-max-rate
        self.job_args = job_args  # more elastic_job.py flags, e.g. --hidden
        self.job = "loss-z2"
        self.save = root / "ckpt" / "z2"
        self.runs = {n: Path(tempfile.mkdtemp(prefix=f"diag-loss-{n}-", dir="/dev/shm"))
                     for n in NODES}  # fmt: skip
        ports = {n: jobrun.free_port() for n in NODES}
        self.ring = ",".join(f"{n}=127.0.0.1:{ports[n]}" for n in NODES)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.trainers: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, node: str) -> dict[str, str]:
        return dict(os.environ, DIAG_RUN_DIR=str(self.runs[node]), DIAG_NODE=node,
                    DIAG_REPLICA_TOKEN="job-secret-replica-token", OMP_NUM_THREADS="1")  # fmt: skip

    def start_agent(self, node: str) -> None:
        self.runs[node].mkdir(mode=0o700, exist_ok=True)
        log = open(self.root / f"agent-{node}.log", "ab")  # noqa: SIM115 - the agent owns it
        # The default --replica-interval: pushes follow the ranks' notes, not the timer. No
        # handover to storage while b is away (it comes back).
        self.agents[node] = subprocess.Popen(
            [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(self.runs[node]),
             "--timeline", str(self.root / f"timeline-{node}"), "--job", self.job, "--node", node,
             "--replica-nodes", self.ring, "--replica-listen", "127.0.0.1",
             "--replica-lost-after", "600", "--native-stacks", "false", "--interval", "0.25",
             "-v", "--replica-dir", str(self.runs[node] / ".replicas"), *self.agent_args],
            env=self.env(node), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()

    def start_trainer(self, node: str, master_port: int, out: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
               str(NODES.index(node)), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(master_port), "--max-restarts", "0", str(JOB_SCRIPT),
               "--zero", "2", "--job-prefix", "loss", "--save-dir", str(self.root / "ckpt"),
               "--out", str(self.root / out), "--steps", "10000",
               "--persist-every", str(PERSIST_EVERY), "--step-sleep", str(STEP_SLEEP),
               *self.job_args]  # fmt: skip
        self.trainers[node] = jobrun.start(cmd, self.root / f"trainer-{node}-{out}.log",
                                           self.env(node))  # fmt: skip

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

    def trained(self, out: str) -> list[int]:
        with contextlib.suppress(OSError):
            text = (self.root / out / "z2" / "loss.jsonl").read_text()
            return [json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")]
        return []

    def logs(self) -> str:
        out = []
        for path in sorted(self.root.glob("*.log")):
            text = path.read_text(errors="replace")
            out.append(f"--- {path.name}\n{text[-2500:]}")
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


@dataclass(frozen=True)
class Loss:
    """One whole-node loss of node-b and the job's restart on both nodes."""

    newest: int  # the newest step trained (its loss written by rank 0) at the loss
    held: int | None  # node-a's replica of node-b at the loss
    storage: int | None  # the step storage's `latest` named at the loss
    start: dict  # the restarted job's start.json: step, from
    pulled: bool  # node-b's new agent logged its restore from node-a at `held`
    fell_back_logged: bool  # rank 0 logged a resume from storage with steps in memory


def start_job(c: TwoNodes, run: str) -> None:
    for node in NODES:
        if node not in c.agents:
            c.start_agent(node)
    for node in NODES:
        wait_for(control_socket_path(c.runs[node], c.job).exists, 120, f"{node}'s agent", c.logs)
    port = jobrun.free_port()
    for node in NODES:
        c.start_trainer(node, port, run)


def lose_and_restart(c: TwoNodes, run: str, next_run: str, past: int) -> Loss:
    """Waits until run `run` trained a step `past` steps beyond a persisted one (a step storage
    does not hold), loses node-b, brings it back empty and restarts the job as `next_run`."""
    first = read_latest_step(c.save) or 0
    wait_for(lambda: any(s > first and s % PERSIST_EVERY == past % PERSIST_EVERY
                         for s in c.trained(run)[-1:]), 600, f"step = {past} mod {PERSIST_EVERY}",
             c.logs)  # fmt: skip
    c.lose("node-b")
    newest = max(c.trained(run))
    held = max(c.held("node-a", "node-b"), default=None)
    storage = read_latest_step(c.save)
    # node a's rank fails with its peer; its torchrun gives up (no restarts)
    assert jobrun.finish(c.trainers.pop("node-a"), timeout=300) != 0, c.logs()
    log_b = c.root / "agent-node-b.log"
    before = log_b.stat().st_size if log_b.exists() else 0
    start_job(c, next_run)
    start_file = c.root / next_run / "z2" / "start.json"
    wait_for(start_file.exists, 300, "the job's restart", c.logs)
    with open(log_b, "rb") as f:
        f.seek(before)
        agent_b = f.read().decode(errors="replace")
    rank0 = (c.root / f"trainer-node-a-{next_run}.log").read_text(errors="replace")
    return Loss(
        newest, held, storage, json.loads(start_file.read_text()),
        f"replica restore: peer step {held}" in agent_b, "resuming from storage" in rank0,
    )  # fmt: skip
