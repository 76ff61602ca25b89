"""Replicas of flash checkpoints in a peer node's memory: what they cost the training step, and
how fast a replaced node restores from one against restoring from storage, side by side in one run.

    .venv/bin/python bench/replica_bench.py --rounds 2 --hidden 512

Each round runs the same real 2-rank DeepSpeed job (tests/support/kill_job.py: gloo, CPU, a
flash checkpoint every step, every step persisted by the agent) twice, alternating: once with the
node's agent alone ("storage"), once with replication to a second agent on this machine standing
in for the holder node ("replica", TCP over loopback). In each:
- the step time: steps the job logs over a window of --window seconds, after --warm steps;
- a node loss: the ranks and the node's agent are SIGKILLed and the node's shared memory wiped;
  a new agent starts (pulling the replica, with replication on) and the next ranks, started and
  imported ahead, are released once it is up; restore time is from the new agent's start to the
  ranks' first step loaded, and the step and its source (memory or storage) are recorded.
Prints a table with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
sys.path.insert(0, str(SUPPORT))

from faults import write_json_atomic  # noqa: E402

JOB = "replica-bench"
WORLD = 2


@dataclass
class Trial:
    mode: str
    step_ms: float
    restore_s: float
    restored_step: int
    restored_from: str
    trained_at_kill: int


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Node:
    """One job on the node, its agent, and (replica mode) the holder's agent."""

    def __init__(self, root: Path, mode: str, hidden: int, ports: tuple[int, int]) -> None:
        self.root, self.mode, self.hidden = root, mode, hidden
        self.ctl = root / "ctl"
        self.ctl.mkdir(parents=True)
        self.save = root / "ckpt"
        self.run_dir = Path(tempfile.mkdtemp(prefix="diag-rb-", dir="/dev/shm"))
        self.holder_run = Path(tempfile.mkdtemp(prefix="diag-rb-h-", dir="/dev/shm"))
        self.env = dict(os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
                        DIAG_REPLICA_TOKEN="bench")  # fmt: skip
        self.spec = f"a=127.0.0.1:{ports[0]},b=127.0.0.1:{ports[1]}"
        self.procs: list[subprocess.Popen] = []
        self.agent_gen = 0

    def agent(self, node: str, run_dir: Path, gen: int) -> subprocess.Popen:
        cmd = [sys.executable, str(SUPPORT / "fault_agent.py"), "--ctl", str(self.ctl), "--go",
               str(self.ctl / f"agent-{node}-go-{gen}"), "--", "agent", "--run-dir", str(run_dir),
               "--job", JOB, "--node", node, "--timeline", str(self.root / "timeline"),
               "--native-stacks", "false", "--interval", "0.5", "--keep-last", "3", "-v"]  # fmt: skip
        if self.mode == "replica":
            cmd += ["--replica-nodes", self.spec, "--replica-interval", "0.05"]
        log = open(self.root / f"agent-{node}-{gen}.log", "ab")  # noqa: SIM115
        p = subprocess.Popen(cmd, env=dict(self.env, DIAG_RUN_DIR=str(run_dir)), stdout=log,
                             stderr=subprocess.STDOUT)  # fmt: skip
        self.procs.append(p)
        return p

    def ranks(self, gen: int) -> list[subprocess.Popen]:
        out = []
        for rank in range(WORLD):
            env = dict(self.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                       LOCAL_WORLD_SIZE=str(WORLD), DIAG_NODE="a")  # fmt: skip
            cmd = [sys.executable, str(SUPPORT / "kill_job.py"), "--zero", "2", "--job", JOB,
                   "--save-dir", str(self.save), "--ctl", str(self.ctl), "--gen", str(gen),
                   "--hidden", str(self.hidden), "--pause", "0"]  # fmt: skip
            log = open(self.root / f"ranks-{gen}.log", "ab")  # noqa: SIM115
            out.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.procs += out
        return out

    def release(self, what: str) -> None:
        write_json_atomic(self.ctl / what, str(self.ctl / f"store-{what}"))

    def steps(self, gen: int) -> list[int]:
        path = self.ctl / f"loss-{gen}.jsonl"
        if not path.exists():
            return []
        return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")]

    def close(self) -> None:
        (self.ctl / "stop").write_text("stop")
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.holder_run, ignore_errors=True)


def settled(procs: list[subprocess.Popen]) -> bool:
    """Whether the processes are idle, waiting for their go file (0.05 s of CPU in 1 s)."""
    import psutil

    def cpu() -> float:
        return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)

    before = cpu()
    time.sleep(1.0)
    return cpu() - before < 0.05


def agent_up(log: Path, mode: str) -> bool:
    text = log.read_text(errors="replace") if log.exists() else ""
    return ("replica restore:" if mode == "replica" else "watching ") in text


def trial(root: Path, mode: str, hidden: int, warm: int, window: float, ports: tuple[int, int]):
    n = Node(root, mode, hidden, ports)
    try:
        if mode == "replica":
            n.agent("b", n.holder_run, 0)
            n.release("agent-b-go-0")
        n.agent("a", n.run_dir, 0)
        n.release("agent-a-go-0")
        ranks = n.ranks(0)
        n.release("go-0")
        wait_for(lambda: len(n.steps(0)) >= warm, 900, f"{warm} steps")
        first, t0 = len(n.steps(0)), time.monotonic()
        time.sleep(window)
        count, seconds = len(n.steps(0)) - first, time.monotonic() - t0
        step_ms = 1000 * seconds / max(count, 1)
        if mode == "replica":  # the holder has the newest step before the kill
            wait_for(lambda: list((n.holder_run / ".replicas").glob("a-*")), 120, "a replica")
        # the node is lost: its ranks, its agent and its shared memory
        nxt_agent = n.agent("a", n.run_dir, 1)
        nxt_ranks = n.ranks(1)
        # the next ones have imported everything (their CPU time stops growing) before the
        # kill, as the processes of a warm replacement pod would have
        wait_for(lambda: settled([nxt_agent, *nxt_ranks]), 600, "the next processes' imports")
        for p in [*ranks, n.procs[1 if mode == "replica" else 0]]:
            p.send_signal(signal.SIGKILL)
            p.wait(30)
        trained = max(n.steps(0), default=0)
        for p in n.run_dir.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        t0 = time.monotonic()
        n.release("agent-a-go-1")
        log = n.root / "agent-a-1.log"
        wait_for(lambda: agent_up(log, mode), 300, "the new agent")
        n.release("go-1")
        start = n.ctl / "start-1.json"
        wait_for(start.exists, 600, "the restore")
        restore_s = time.monotonic() - t0
        doc = json.loads(start.read_text())
        return Trial(mode, step_ms, restore_s, doc["step"], doc["from"], trained)
    finally:
        n.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512, help="width of the job's MLP")
    p.add_argument("--warm", type=int, default=20, help="steps before the window")
    p.add_argument("--window", type=float, default=20.0, help="seconds of steps counted")
    p.add_argument("--ports", default="29611,29612")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    a, b = (int(x) for x in args.ports.split(","))
    root = Path(tempfile.mkdtemp(prefix="diag-replica-bench-"))
    trials: list[Trial] = []
    try:
        for r in range(args.rounds):
            for mode in ("storage", "replica") if r % 2 == 0 else ("replica", "storage"):
                t = trial(root / f"{r}-{mode}", mode, args.hidden, args.warm, args.window, (a, b))
                print(f"round {r + 1} {mode:8s} step {t.step_ms:7.1f} ms  restore "
                      f"{t.restore_s:6.2f} s  step {t.restored_step} from {t.restored_from} "
                      f"(trained {t.trained_at_kill})", flush=True)  # fmt: skip
                trials.append(t)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(getattr(t, key) for t in trials if t.mode == mode)

    base, rep = med("storage", "step_ms"), med("replica", "step_ms")
    rs, rr = med("storage", "restore_s"), med("replica", "restore_s")
    print("\n| | storage only | with a replica | ratio |\n|---|---|---|---|")
    print(
        f"| step time, ms (median of {args.rounds}) | {base:.1f} | {rep:.1f} | {rep / base:.3f} |"
    )
    print(
        f"| node restore, s (agent start to state loaded) | {rs:.2f} | {rr:.2f} | {rr / rs:.2f} |"
    )
    lost = [f"{t.mode} {t.trained_at_kill - t.restored_step}" for t in trials]
    print(f"steps trained again after the node loss (trained - restored): {', '.join(lost)}")
    if args.json:
        args.json.write_text(json.dumps([t.__dict__ for t in trials], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
