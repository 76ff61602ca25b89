"""Replicas of flash checkpoints in a peer node's memory: what they cost the training step, and
how fast a replaced node restores from one against restoring from storage, side by side in one run.

    .venv/bin/python bench/replica_bench.py --rounds 2 --warm 20 --window 60

Each round runs the same real 2-rank DeepSpeed job (tests/support/jobs/kill_job.py: gloo, CPU, a
flash checkpoint in memory every step, every --persist-every'th step persisted to storage by the
agent) twice, alternating: once with the node's agent alone ("storage"), once with replication of
every step to a second agent on this machine standing in for the holder node ("replica", TCP over
loopback). The shape of a real node is kept in both modes:
- CPU placement (--rank-cpus, --agent-cpus; on by default where the machine has 2 CPUs or more):
  the ranks run on one set of CPUs, both agents (the node's and the holder's) on another, as an
  agent has cores of its own on a real node and the holder is another machine;
- a cold page cache at the restore (unless --warm-storage): after the node loss, every file under
  the save directory is written back and evicted from the page cache (posix_fadvise DONTNEED), as a
  replaced node has nothing of the checkpoint in memory.
In each:
- the step time: steps the job logs over a window of --window seconds, after --warm steps, and the
  CPU seconds per step of the node's agent and of the holder's agent over that window (what
  replication costs a node's CPU budget);
- a node loss: the ranks and the node's agent are SIGKILLed and the node's shared memory wiped;
  a new agent (pulling the replica, with replication on) and the next ranks, both started and
  imported ahead, are released together, as a pod's containers start (--agent-first: the ranks
  once the agent is up); the ranks run with DIAG_AGENT_WAIT, so on the empty node they wait for
  the agent before they look for snapshots. Restore time is from that release to the ranks' state
  loaded, and the step, its source (memory or storage), the bytes restored, the ranks' own load
  and (replica) the pull's own seconds from the agent's log are recorded.

For a state large enough that reading it counts against starting DeepSpeed, --hidden 2800 gives
1 GB of checkpoint per node (63 M parameters, fp32 Adam): use --persist-every 5 and --warm 6, as a
step takes seconds there.
Prints a table with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
sys.path.insert(0, str(SUPPORT))
import repo  # noqa: E402  (tests/support: where every helper folder is)

repo.on_sys_path()

from faults import write_json_atomic  # noqa: E402
from nodeshape import (  # noqa: E402
    cached_bytes,
    cpu_list,
    cpu_seconds,
    evict,
    parse_cpus,
    pinned,
    settled,
    tree_bytes,
)

JOB = "replica-bench"
WORLD = 2


@dataclass(frozen=True)
class Setup:
    """What every trial of a run shares."""

    hidden: int
    warm: int
    window: float
    ports: tuple[int, int]
    persist_every: int
    rank_cpus: frozenset[int] | None  # None: not pinned
    agent_cpus: frozenset[int] | None
    cold: bool  # evict the save directory from the page cache before the restore
    together: bool  # the new ranks start with the new agent, not once it is up
    max_rate: str | None  # the agents' --replica-max-rate


@dataclass
class Trial:
    mode: str
    step_ms: float
    steps_in_window: int
    node_agent_cpu_ms: float  # CPU per step of the node's agent over the window
    holder_agent_cpu_ms: float | None  # the holder's agent's (replica mode)
    ranks_cpu_ms: float  # both ranks together
    restore_s: float
    agent_up_s: float  # of restore_s: the new agent's start until it is up (and has pulled)
    restored_step: int
    restored_from: str
    trained_at_kill: int
    restored_bytes: int
    pull_s: float | None = None  # the replica pull's own seconds, from the new agent's log
    load_s: float | None = None  # of restore_s: rank 0's FlashCheckpointer.load() alone
    engine_s: float | None = None  # of restore_s: the release to rank 0's load() (its engine)
    cache_before: int | None = None  # bytes of the save directory in the page cache, at the loss
    cache_after: int | None = None  # ... after the eviction
    notes: list[str] = field(default_factory=list)


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


PULL_LOG = re.compile(r"replica restore: (\w+)(?: step (\d+))? \((.*); ([0-9.]+) s\)")


class Node:
    """One job on the node, its agent, and (replica mode) the holder's agent."""

    def __init__(self, root: Path, mode: str, setup: Setup) -> None:
        self.root, self.mode, self.setup = root, mode, setup
        self.ctl = root / "ctl"
        self.ctl.mkdir(parents=True)
        self.save = root / "ckpt"
        self.run_dir = Path(tempfile.mkdtemp(prefix="diag-rb-", dir="/dev/shm"))
        self.holder_run = Path(tempfile.mkdtemp(prefix="diag-rb-h-", dir="/dev/shm"))
        self.env = dict(os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1",
                        PYTHONPATH=repo.pythonpath(os.environ.get("PYTHONPATH", "")),
                        DIAG_REPLICA_TOKEN="replica-bench-token-0123", DIAG_AGENT_WAIT="60")  # fmt: skip
        ports = setup.ports
        self.spec = f"a=127.0.0.1:{ports[0]},b=127.0.0.1:{ports[1]}"
        self.procs: list[subprocess.Popen] = []

    def agent(self, node: str, run_dir: Path, gen: int) -> subprocess.Popen:
        cmd = [sys.executable, str(SUPPORT / "jobs" / "fault_agent.py"), "--ctl", str(self.ctl), "--go",
               str(self.ctl / f"agent-{node}-go-{gen}"), "--", "agent", "--run-dir", str(run_dir),
               "--job", JOB, "--node", node, "--timeline", str(self.root / "timeline"),
               "--native-stacks", "false", "--interval", "0.5", "--keep-last", "3", "-v"]  # fmt: skip
        if self.mode == "replica":
            cmd += ["--replica-nodes", self.spec, "--replica-interval", "0.05"]
            cmd += ["--replica-dir", str(run_dir / ".replicas")]  # in the node's memory
            if self.setup.max_rate:
                cmd += ["--replica-max-rate", self.setup.max_rate]
        log = open(self.root / f"agent-{node}-{gen}.log", "ab")  # noqa: SIM115
        p = subprocess.Popen(cmd, env=dict(self.env, DIAG_RUN_DIR=str(run_dir)), stdout=log,
                             stderr=subprocess.STDOUT,
                             preexec_fn=pinned(self.setup.agent_cpus))  # fmt: skip
        self.procs.append(p)
        return p

    def ranks(self, gen: int) -> list[subprocess.Popen]:
        out = []
        for rank in range(WORLD):
            env = dict(self.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                       LOCAL_WORLD_SIZE=str(WORLD), DIAG_NODE="a")  # fmt: skip
            cmd = [sys.executable, str(SUPPORT / "jobs" / "kill_job.py"), "--zero", "2", "--job", JOB,
                   "--save-dir", str(self.save), "--ctl", str(self.ctl), "--gen", str(gen),
                   "--hidden", str(self.setup.hidden), "--pause", "0",
                   "--persist-every", str(self.setup.persist_every)]  # fmt: skip
            log = open(self.root / f"ranks-{gen}.log", "ab")  # noqa: SIM115
            out.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        preexec_fn=pinned(self.setup.rank_cpus)))  # fmt: skip
        self.procs += out
        return out

    def release(self, what: str) -> None:
        write_json_atomic(self.ctl / what, str(self.ctl / f"store-{what}"))

    def steps(self, gen: int) -> list[int]:
        path = self.ctl / f"loss-{gen}.jsonl"
        if not path.exists():
            return []
        return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")]

    def held_bytes(self) -> int:
        """Bytes of the replica the holder holds for node a, from its manifest."""
        for m in (self.holder_run / ".replicas").glob("a-*/replica.json"):
            return sum(p[2] for p in json.loads(m.read_text())["manifest"]["parts"])
        return 0

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


def agent_up(log: Path, mode: str) -> bool:
    text = log.read_text(errors="replace") if log.exists() else ""
    return ("replica restore:" if mode == "replica" else "watching ") in text


def trial(root: Path, mode: str, setup: Setup) -> Trial:
    from diag.formats.snapshot import step_tag

    n = Node(root, mode, setup)
    try:
        holder = None
        if mode == "replica":
            holder = n.agent("b", n.holder_run, 0)
            n.release("agent-b-go-0")
        node_agent = n.agent("a", n.run_dir, 0)
        n.release("agent-a-go-0")
        ranks = n.ranks(0)
        n.release("go-0")
        wait_for(lambda: len(n.steps(0)) >= setup.warm, 900, f"{setup.warm} steps")
        watched = [node_agent, *([holder] if holder else []), *ranks]
        cpu0 = [cpu_seconds(p) for p in watched]
        first, t0 = len(n.steps(0)), time.monotonic()
        time.sleep(setup.window)
        count, seconds = len(n.steps(0)) - first, time.monotonic() - t0
        cpu = [cpu_seconds(p) - c for p, c in zip(watched, cpu0, strict=True)]
        per = max(count, 1)
        step_ms = 1000 * seconds / per
        node_cpu, holder_cpu = 1000 * cpu[0] / per, (1000 * cpu[1] / per if holder else None)
        ranks_cpu = 1000 * sum(cpu[-WORLD:]) / per
        if mode == "replica":  # the holder has the newest step before the kill
            wait_for(lambda: list((n.holder_run / ".replicas").glob("a-*")), 120, "a replica")
        # the node is lost: its ranks, its agent and its shared memory
        nxt_agent = n.agent("a", n.run_dir, 1)
        nxt_ranks = n.ranks(1)
        # the next ones have imported everything (their CPU time stops growing) before the
        # kill, as the processes of a warm replacement pod would have
        wait_for(lambda: settled([nxt_agent, *nxt_ranks]), 600, "the next processes' imports")
        # all at once, the agent first: an agent that outlived its ranks would persist their
        # newest step on their death, which a lost node never does
        for p in [node_agent, *ranks]:
            p.send_signal(signal.SIGKILL)
        for p in [node_agent, *ranks]:
            p.wait(30)
        trained = max(n.steps(0), default=0)
        held = n.held_bytes() if mode == "replica" else 0
        for p in n.run_dir.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        before = after = None
        if n.save.exists():
            before = cached_bytes(n.save)
            if setup.cold:
                evict(n.save)
            after = cached_bytes(n.save)
        log, start = n.root / "agent-a-1.log", n.ctl / "start-1.json"
        t0, released = time.monotonic(), time.time()
        n.release("agent-a-go-1")
        if setup.together:
            # a pod's containers start together: the ranks build their engine while the agent
            # pulls, and wait for its pull (its marker) only when they look for snapshots
            n.release("go-1")
        agent_up_s = restore_s = None
        deadline = t0 + 900
        while restore_s is None:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError("timed out waiting for the restore")
            if agent_up_s is None and agent_up(log, mode):
                agent_up_s = now - t0
                if not setup.together:
                    n.release("go-1")
            if start.exists():
                restore_s = now - t0
            time.sleep(0.01)
        if agent_up_s is None:  # loaded before the agent said it was up
            agent_up_s = restore_s
        doc = json.loads(start.read_text())
        t = Trial(mode, step_ms, count, node_cpu, holder_cpu, ranks_cpu, restore_s, agent_up_s,
                  doc["step"],
                  doc["from"], trained, 0, cache_before=before, cache_after=after,
                  load_s=doc.get("load_s"))  # fmt: skip
        if not setup.together:
            released += agent_up_s
        if "loading_at" in doc:
            t.engine_s = doc["loading_at"] - released
        if doc["from"] == "storage":
            tag = n.save / step_tag(doc["step"])
            t.restored_bytes = tree_bytes(tag) if tag.is_dir() else 0
        else:
            t.restored_bytes = held
        if mode == "replica":
            found = PULL_LOG.search(log.read_text(errors="replace"))
            if found:
                t.pull_s = float(found.group(4))
                if found.group(1) != "peer":
                    t.notes.append(f"the new agent restored from {found.group(1)}")
        return t
    finally:
        n.close()


def mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def describe(t: Trial) -> str:
    holder = "-" if t.holder_agent_cpu_ms is None else f"{t.holder_agent_cpu_ms:.1f}"
    pull = "" if t.pull_s is None else f", its pull {t.pull_s:.2f} s"
    pull += "" if t.engine_s is None else f", the ranks' engine {t.engine_s:.2f} s"
    pull += "" if t.load_s is None else f", the ranks' load {t.load_s:.2f} s"
    notes = "".join("; " + x for x in t.notes)
    return (
        f"{t.mode:8s} step {t.step_ms:7.1f} ms ({t.steps_in_window} steps), agent CPU/step: "
        f"node {t.node_agent_cpu_ms:.1f} ms, holder {holder} ms, ranks {t.ranks_cpu_ms:.0f} ms; "
        f"restore {t.restore_s:6.2f} s (agent up {t.agent_up_s:.2f} s{pull}): step "
        f"{t.restored_step} from {t.restored_from}, {mb(t.restored_bytes)} (trained "
        f"{t.trained_at_kill}); save dir in page cache {mb(t.cache_before)} -> "
        f"{mb(t.cache_after)}{notes}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512, help="width of the job's MLP")
    p.add_argument("--warm", type=int, default=20, help="steps before the window")
    p.add_argument("--window", type=float, default=60.0, help="seconds of steps counted")
    p.add_argument("--ports", default="29611,29612")
    p.add_argument("--persist-every", type=int, default=20,
                   help="persist every Nth step to storage (every step stays in memory and, in "
                        "replica mode, is replicated)")  # fmt: skip
    cpus = sorted(os.sched_getaffinity(0))
    p.add_argument("--rank-cpus", type=parse_cpus,
                   default=frozenset(cpus[:-1]) if len(cpus) >= 2 else None,
                   help="CPUs of the training ranks (default: all but the last)")  # fmt: skip
    p.add_argument(
        "--agent-cpus",
        type=parse_cpus,
        default=frozenset(cpus[-1:]) if len(cpus) >= 2 else None,
        help="CPUs of both agents, the node's and the holder's (default: the last)",
    )
    p.add_argument("--no-pin", action="store_true", help="leave every process on every CPU")
    p.add_argument("--warm-storage", action="store_true",
                   help="leave the checkpoint files in the page cache at the restore")  # fmt: skip
    p.add_argument("--agent-first", action="store_true",
                   help="release the new ranks only once the new agent is up (and has pulled); "
                        "by default they start together, as a pod's containers do")  # fmt: skip
    p.add_argument("--json", type=Path)
    p.add_argument("--max-rate", help="the agents' --replica-max-rate (default: no cap)")
    p.add_argument("--keep", action="store_true", help="keep the agents' and ranks' logs")
    args = p.parse_args()
    if args.persist_every < 1:
        p.error("--persist-every must be at least 1")
    a, b = (int(x) for x in args.ports.split(","))
    rank_cpus, agent_cpus = (None, None) if args.no_pin else (args.rank_cpus, args.agent_cpus)
    if (rank_cpus is None) != (agent_cpus is None):
        p.error("--rank-cpus and --agent-cpus go together")
    setup = Setup(args.hidden, args.warm, args.window, (a, b), args.persist_every, rank_cpus,
                  agent_cpus, not args.warm_storage, not args.agent_first,
                  args.max_rate)  # fmt: skip
    placement = (
        "not pinned" if rank_cpus is None
        else f"ranks on CPU {cpu_list(rank_cpus)}, both agents on CPU {cpu_list(agent_cpus)}"
    )  # fmt: skip
    cache = "warm page cache (--warm-storage)" if args.warm_storage else (
        "cold page cache (the save directory evicted with posix_fadvise DONTNEED)")  # fmt: skip
    starts = ("the new ranks released once the new agent is up (--agent-first)" if args.agent_first
              else "the new ranks and agent started together")  # fmt: skip
    header = (f"placement: {placement}; persist to storage every {args.persist_every} steps, "
              f"every step in memory and replicated"
              f"{f' at most {args.max_rate}/s' if args.max_rate else ''}; restore from a {cache}; "
              f"{starts}")  # fmt: skip
    print(header, flush=True)
    root = Path(tempfile.mkdtemp(prefix="diag-replica-bench-"))
    trials: list[Trial] = []
    try:
        for r in range(args.rounds):
            for mode in ("storage", "replica") if r % 2 == 0 else ("replica", "storage"):
                t = trial(root / f"{r}-{mode}", mode, setup)
                print(f"round {r + 1} {describe(t)}", flush=True)
                trials.append(t)
    finally:
        if args.keep:
            print(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(getattr(t, key) for t in trials if t.mode == mode)

    def cell(mode: str, key: str, fmt: str) -> str:
        vals = [getattr(t, key) for t in trials if t.mode == mode]
        if any(v is None for v in vals):
            return "-"
        return format(statistics.median(vals), fmt)

    base, rep = med("storage", "step_ms"), med("replica", "step_ms")
    rs, rr = med("storage", "restore_s"), med("replica", "restore_s")
    print(f"\n{header}; medians of {args.rounds}")
    print("\n| | storage only | with a replica | ratio |\n|---|---|---|---|")
    print(f"| step time, ms | {base:.1f} | {rep:.1f} | {rep / base:.3f} |")
    for key, what in (("node_agent_cpu_ms", "node agent CPU per step, ms"),
                      ("holder_agent_cpu_ms", "holder agent CPU per step, ms"),
                      ("ranks_cpu_ms", "ranks' CPU per step (both), ms")):  # fmt: skip
        print(f"| {what} | {cell('storage', key, '.1f')} | {cell('replica', key, '.1f')} | |")
    print(f"| node restore, s (agent start to state loaded) | {rs:.2f} | {rr:.2f} | "
          f"{rr / rs:.2f} |")  # fmt: skip
    print(f"| of which the new agent up, s | {cell('storage', 'agent_up_s', '.2f')} | "
          f"{cell('replica', 'agent_up_s', '.2f')} | |")  # fmt: skip
    print(f"| of which the replica pull (agent's log), s | - | {cell('replica', 'pull_s', '.2f')} "
          f"| |")  # fmt: skip
    print(
        f"| of which the ranks' start to their engine built, s | "
        f"{cell('storage', 'engine_s', '.2f')} | {cell('replica', 'engine_s', '.2f')} | |"
    )
    print(
        f"| of which the ranks' load (FlashCheckpointer.load, with any wait for the agent), s | "
        f"{cell('storage', 'load_s', '.2f')} | {cell('replica', 'load_s', '.2f')} | |"
    )
    print(f"| bytes restored, MB | {med('storage', 'restored_bytes') / 1e6:.1f} | "
          f"{med('replica', 'restored_bytes') / 1e6:.1f} | |")  # fmt: skip
    lost = [f"{t.mode} {t.trained_at_kill - t.restored_step}" for t in trials]
    print(f"steps trained again after the node loss (trained - restored): {', '.join(lost)}")
    if args.json:
        args.json.write_text(json.dumps([t.__dict__ for t in trials], indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
