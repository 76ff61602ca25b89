"""One job of the goodput bench (bench/goodput.py) and its test, driven through a fault schedule:
two "nodes" on this machine, each with its own launcher (torchrun, or dlrover-run), its own run
directory (the diag agent's journals and flash-checkpoint slots, in /dev/shm) and, for diag, its own
`diag agent`; the launchers meet in a c10d rendezvous that node-a hosts.

Faults of kind kill, hang and gil fire inside the ranks (tests/support/jobs/goodput_job.py); this
harness fires the node faults on node-b, the node that does not host the rendezvous:

- preempt: SIGTERM to the node's launcher and agent (the pod's containers), SIGKILL to whatever of
  the node is left after the grace period, then the node comes back (run directory kept);
- lost: SIGKILL to every process of the node, its run directory wiped; it comes back empty.

With the diag stack each node's agent also holds the other's newest flash checkpoint in its memory
(--replica-nodes, both agents on 127.0.0.1 at ports of their own): a lost node's agent pulls its
ranks' snapshots back from node-a before they start, and they resume from memory.

Everything is logged as JSON lines in <root>/out/events.jsonl (goodput_job.py's events, and the
harness's: fault (with `replica`, the step node-a held for node-b when node-b went), node_down,
node_up, pulled (where a node's agent took its ranks' snapshots from at start, as it logged it),
gone (a rank's process seen gone, polled every 0.1 s)).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from jobrun import free_port
from repo import JOBS

from diag.agent.observe.procs import stop_tree

JOB = JOBS / "goodput_job.py"
DLROVER_RUN = JOBS / "launchers" / "dlrover_run.py"
KINDS = ("kill", "hang", "gil", "preempt", "lost")
RANK_KINDS = ("kill", "hang", "gil")
NODES = ("node-a", "node-b")


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str
    step: int
    rank: int  # the global rank that fires it (rank faults); -1 for node faults (node-b)


def schedule(seed: int, steps: int, kinds: tuple[str, ...] = KINDS, world: int = 4) -> list[Fault]:
    """Each kind once, in a seeded order, at seeded steps spread over the run: the first after a
    warm-up of a tenth of the steps, the last a tenth before the end, a gap of at least
    steps / (2 x faults) between two (so each is recovered before the next fires)."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    lo, hi = max(3, steps // 10), steps - max(2, steps // 10)
    slot = (hi - lo) / len(order)
    out = []
    for i, kind in enumerate(order):
        step = int(lo + slot * i + rng.uniform(0, slot / 2))
        rank = rng.randrange(world) if kind in RANK_KINDS else -1
        out.append(Fault(i, kind, step, rank))
    return out


@dataclass(frozen=True)
class JobSpec:
    stack: str  # default | diag | dlrover
    steps: int
    hidden: int
    every: int  # storage checkpoint every N steps
    nproc: int = 2  # ranks per node
    grace: float = 30.0  # preemption's grace period, s
    pg_timeout: float = 60.0
    agent_args: tuple[str, ...] = ()
    wait_saves: bool = False  # `saved` means the flash copy is done (the test's "complete")
    timeout: float = 3600.0
    replicas: bool = True  # diag: each node's agent holds the other's flash checkpoint
    replica_interval: float = 0.05  # s between the agents' looks for a newer step to send
    device: str = "cpu"  # cpu: gloo; cuda: NCCL, every rank on GPU 0 (nproc 1: see nccl_env)

    @property
    def world(self) -> int:
        return len(NODES) * self.nproc


@dataclass
class Node:
    name: str
    run_dir: Path
    env: dict[str, str]
    launcher: subprocess.Popen | None = None
    agent: subprocess.Popen | None = None
    launches: int = 0
    replica_port: int = 0


@dataclass
class Outcome:
    finished: bool
    wall: float
    t0: float
    why: str = ""
    faults: list[Fault] = field(default_factory=list)


# The agent's line for where it took the node's snapshots from (agent.replica.replicator).
_PULLED = re.compile(r"replica restore: (\w+)(?: step (\d+))?")


def nccl_env(run_id: str, node: str, root: Path) -> dict[str, str]:
    """A node's NCCL settings when the ranks of both nodes share GPU 0 of this machine."""
    trace = str(root / f"nccl-trace-{node}-rank")
    return {
        # NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"): a host id of
        # its own per node makes them two hosts, joined by NCCL's socket transport over the
        # loopback (which NCCL skips unless named), with no InfiniBand to look for.
        "NCCL_HOSTID": f"{run_id}-{node}",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        # A collective timeout's flight-recorder dump lands with the run, not in /tmp (the
        # setting under both of its names).
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace,
        "TORCH_FR_DUMP_TEMP_FILE": trace,
    }


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class GoodputJob:
    def __init__(self, spec: JobSpec, faults: list[Fault], root: Path, log: Callable[[str], None]):
        self.spec, self.faults, self.root, self.log = spec, faults, root, log
        self.out = root / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.save = root / "ckpt"
        self.timeline = root / "timeline"
        (root / "faults.json").write_text(json.dumps([asdict(f) for f in faults]))
        self.port = free_port()
        self.run_id = f"goodput{os.getpid()}x{self.port}"
        self.events_fd = os.open(
            self.out / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
        )
        self.nodes = []
        for name in NODES:
            run = Path(tempfile.mkdtemp(prefix=f"diag-goodput-{name}-", dir="/dev/shm"))
            env = dict(
                os.environ, DIAG_RUN_DIR=str(run), DIAG_NODE=name, DIAG_JOB="goodput",
                OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                # DLRover names its shared memory and sockets after the job: one per node.
                ELASTIC_JOB_NAME=f"{self.run_id}-{name}",
            )  # fmt: skip
            if spec.device == "cuda":
                env.update(nccl_env(self.run_id, name, root))
            self.nodes.append(Node(name, run, env))
        self.ring = ""
        if spec.stack in ("diag", "inplace") and spec.replicas:
            ports: set[int] = set()
            while len(ports) < len(self.nodes):
                ports.add(free_port())
            token = secrets.token_hex(16)
            for n, port in zip(self.nodes, sorted(ports), strict=True):
                n.replica_port = port
                n.env["DIAG_REPLICA_TOKEN"] = token  # through the environment, as advised
            self.ring = ",".join(f"{n.name}=127.0.0.1:{n.replica_port}" for n in self.nodes)
        self.master: subprocess.Popen | None = None
        if spec.stack == "dlrover":
            # DLRover's job master (its own pod in a cluster); the nodes' agents meet there.
            master = free_port()
            with open(root / "dlrover-master.log", "wb") as f:
                self.master = subprocess.Popen(
                    [sys.executable, "-m", "dlrover.python.master.main", "--port", str(master),
                     "--node_num", "2", "--job_name", self.run_id, "--platform", "local"],
                    env=dict(os.environ), stdout=f, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            for i, n in enumerate(self.nodes):
                n.env.update(
                    DLROVER_MASTER_ADDR=f"127.0.0.1:{master}", NODE_ID=str(i), NODE_RANK=str(i),
                    NODE_NUM="2",
                )  # fmt: skip
        self.pids: dict[int, str] = {}  # rank processes seen (pid -> node)
        self.started: dict[int, float] = {}
        self.gone: set[int] = set()
        self._offset = 0
        self.progress = 0  # the step last trained
        self.last_fault = 0.0  # when the last fault fired
        self.healthy = 0  # newest step trained after it: a node fault waits for its step here

    # -- events ------------------------------------------------------------------------------

    def note(self, ev: str, **row: object) -> None:
        line = json.dumps({"ev": ev, "t": time.time(), "pid": os.getpid(), **row}) + "\n"
        os.write(self.events_fd, line.encode())

    def _read_new(self) -> list[dict]:
        path = self.out / "events.jsonl"
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [json.loads(x) for x in data[:end].splitlines() if x.strip()]

    def _poll(self) -> list[dict]:
        rows = self._read_new()
        for r in rows:
            if r["ev"] == "start":
                self.pids[r["pid"]] = r.get("node", "")
                self.started[r["pid"]] = r["t"]
            elif r["ev"] == "step":
                self.progress = r["step"]
                if self.started.get(r["pid"], 0.0) > self.last_fault:  # a process since
                    self.healthy = max(self.healthy, r["step"])
            elif r["ev"] == "fault":
                self.last_fault, self.healthy = max(self.last_fault, r["t"]), 0
        for pid, node in self.pids.items():
            if pid in self.gone:
                continue
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                self.gone.add(pid)
                self.note("gone", rank_pid=pid, node=node)
        return rows

    def _latest(self) -> int | None:
        try:
            return int((self.save / "latest").read_text().strip().removeprefix("global_step"))
        except (OSError, ValueError):
            return None

    # -- nodes -------------------------------------------------------------------------------

    def _launcher_cmd(self, node: Node) -> list[str]:
        s = self.spec
        job = [str(JOB), "--stack", s.stack, "--steps", str(s.steps), "--hidden", str(s.hidden),
               "--every", str(s.every), "--save-dir", str(self.save), "--out", str(self.out),
               "--faults", str(self.root / "faults.json"), "--pg-timeout", str(s.pg_timeout),
               "--device", s.device, *(["--wait-saves"] if s.wait_saves else [])]  # fmt: skip
        host = "true" if node.name == NODES[0] else "false"
        if s.stack == "dlrover":
            return [sys.executable, str(DLROVER_RUN), "--nnodes", "2", "--nproc_per_node",
                    str(s.nproc), "--max-restarts", "50", *job]  # fmt: skip
        # inplace: diag launch takes torchrun's arguments, and a warm spare per node.
        launch = (["-m", "diag.cli.main", "launch", "--spares", "1"] if s.stack == "inplace"
                  else ["-m", "torch.distributed.run"])  # fmt: skip
        return [sys.executable, *launch, "--nnodes", "2",
                "--nproc-per-node", str(s.nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id,
                "--rdzv-conf", f"is_host={host}", "--max-restarts", "50",
                "--monitor-interval", "0.1", *job]  # fmt: skip

    def start_node(self, node: Node) -> None:
        node.run_dir.mkdir(mode=0o700, exist_ok=True)
        tag = f"{node.name}.{node.launches}"
        if self.spec.stack in ("diag", "inplace"):
            replicas = [] if not self.ring else [
                "--replica-nodes", self.ring, "--replica-listen", "127.0.0.1",
                "--replica-interval", str(self.spec.replica_interval),
                # In the node's memory, where a lost node's wipe reaches it.
                "--replica-dir", str(node.run_dir / ".replicas"),
            ]  # fmt: skip
            on_hang = "recover" if self.spec.stack == "inplace" else "stop"
            with open(self.root / f"agent-{tag}.log", "wb") as f:
                node.agent = subprocess.Popen(
                    [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir",
                     str(node.run_dir), "--timeline", str(self.timeline), "--job", "goodput",
                     "--node", node.name, "--native-stacks", "false", "--on-hang", on_hang,
                     "--termination-grace", str(self.spec.grace), "-v", *replicas,
                     *self.spec.agent_args],
                    env=node.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            sock = node.run_dir / "goodput.control.sock"
            deadline = time.monotonic() + 120
            while not sock.exists() and time.monotonic() < deadline:
                if node.agent.poll() is not None:
                    break
                time.sleep(0.05)
            if self.ring:
                self._note_pulled(node, self.root / f"agent-{tag}.log")
        with open(self.root / f"launcher-{tag}.log", "wb") as f:
            node.launcher = subprocess.Popen(
                self._launcher_cmd(node), env=node.env, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        node.launches += 1
        self.note("node_up", node=node.name)

    def _wait_gone(self, node: Node, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        procs = [p for p in (node.launcher, node.agent) if p is not None]
        while time.monotonic() < deadline:
            self._poll()
            if all(p.poll() is not None for p in procs) and not self._node_ranks_alive(node):
                return True
            time.sleep(0.05)
        return False

    def _node_ranks_alive(self, node: Node) -> bool:
        return any(n == node.name and pid not in self.gone for pid, n in self.pids.items())

    def _kill_node(self, node: Node) -> None:
        for p in (node.launcher, node.agent):
            if p is None:
                continue
            with contextlib.suppress(psutil.NoSuchProcess):
                tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
                for q in tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        q.kill()
            p.wait(30)
        # Ranks that outlived their launcher (re-parented) go too.
        for pid, n in self.pids.items():
            if n == node.name and pid not in self.gone:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _held_replica(self, holder: Node, of: Node) -> int | None:
        """The step of `of`'s replica that `holder`'s agent holds complete (agent.replica.store's
        layout: <run dir>/.replicas/<node>-<step>-<nonce>/replica.json), or None."""
        steps = []
        for p in (holder.run_dir / ".replicas").glob(f"{of.name}-*-*"):
            step = p.name.removeprefix(f"{of.name}-").split("-")[0]
            if step.isdigit() and (p / "replica.json").exists():
                steps.append(int(step))
        return max(steps, default=None)

    def _note_fault(self, fault: Fault, node: Node) -> None:
        self.note(
            "fault", id=fault.id, kind=fault.kind, node=node.name, step=self.progress,
            latest=self._latest(),
        )  # fmt: skip

    def _note_pulled(self, node: Node, log: Path) -> None:
        """Where the node's agent took the ranks' snapshots from at its start (it logs that before
        it opens its control socket, which start_node waited for)."""
        text = log.read_text(errors="replace") if log.exists() else ""
        m = _PULLED.search(text)
        if m is None:
            self.note("pulled", node=node.name, source="unknown", step=None)
            return
        step = int(m.group(2)) if m.group(2) else None
        self.note("pulled", node=node.name, source=m.group(1), step=step)

    def preempt(self, node: Node, fault: Fault) -> None:
        self._note_fault(fault, node)
        for p in (node.launcher, node.agent):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        if not self._wait_gone(node, self.spec.grace):
            self.log(f"  {node.name}: still running after the {self.spec.grace:g} s grace: SIGKILL")
            self._kill_node(node)
            self._wait_gone(node, 30)
        self.note("node_down", node=node.name)
        self.start_node(node)

    def lose(self, node: Node, fault: Fault) -> None:
        fired = dict(t=time.time(), step=self.progress, latest=self._latest())
        self._kill_node(node)
        self._wait_gone(node, 30)
        # Read once the node's agent is gone: no push of it can complete after that.
        holder = next(n for n in self.nodes if n is not node)
        replica = self._held_replica(holder, node) if self.ring else None
        self.note("fault", id=fault.id, kind=fault.kind, node=node.name, replica=replica, **fired)
        shutil.rmtree(node.run_dir, ignore_errors=True)
        for p in Path("/dev/shm").glob(f"*{self.run_id}-{node.name}*"):
            with contextlib.suppress(OSError):
                p.unlink()
        shutil.rmtree(Path("/tmp/ckpt_sock") / f"{self.run_id}-{node.name}", ignore_errors=True)
        self.note("node_down", node=node.name)
        self.start_node(node)

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> Outcome:
        t0 = time.time()
        self.note("begin")
        a, b = self.nodes
        self.start_node(a)
        deadline = time.monotonic() + (0 if self.spec.stack == "dlrover" else 120)
        while not _listening(self.port) and time.monotonic() < deadline:
            if a.launcher is not None and a.launcher.poll() is not None:
                break
            time.sleep(0.05)
        self.start_node(b)
        pending = [f for f in self.faults if f.kind not in RANK_KINDS]
        done: set[int] = set()
        last_print = 0.0
        why = ""
        end = time.monotonic() + self.spec.timeout
        while True:
            rows = self._poll()
            for r in rows:
                if r["ev"] == "fault" and r["pid"] != os.getpid():
                    self.log(f"  fault {r['kind']} on rank {r['rank']} at step {r['step']}")
                elif r["ev"] == "done":
                    done.add(r["pid"])
            if len(done) >= self.spec.world:
                break
            if pending and self.healthy >= pending[0].step:
                f = pending.pop(0)
                self.log(f"  fault {f.kind} on node-b at step {self.progress}")
                (self.preempt if f.kind == "preempt" else self.lose)(b, f)
            if time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                self.log(f"  {self.spec.stack}: step {self.progress}/{self.spec.steps}, "
                         f"{time.time() - t0:.0f} s")  # fmt: skip
            for n in self.nodes:
                if n.launcher is not None and n.launcher.poll() not in (None, 0):
                    why = f"{n.name}'s launcher exited with {n.launcher.returncode}"
            if why:
                break
            if time.monotonic() > end:
                why = f"not finished after {self.spec.timeout:g} s"
                break
            time.sleep(0.1)
        wall = time.time() - t0
        for n in self.nodes:
            if n.launcher is not None and not why:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    n.launcher.wait(60)
        self.note("end")
        return Outcome(not why, wall, t0, why, self.faults)

    def close(self) -> None:
        if self.master is not None and self.master.poll() is None:
            stop_tree(self.master.pid, grace=5)
            self.master.wait(10)
        for n in self.nodes:
            for p in (n.launcher, n.agent):
                if p is not None and p.poll() is None:
                    stop_tree(p.pid, grace=5)
                    p.wait(10)
        self._poll()
        for pid in self.pids:
            if pid not in self.gone:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for n in self.nodes:
            shutil.rmtree(n.run_dir, ignore_errors=True)
        for p in Path("/dev/shm").glob(f"*{self.run_id}*"):
            with contextlib.suppress(OSError):
                p.unlink()
        # DLRover's sockets, named after the job (a launcher killed never removes them).
        for p in Path("/tmp/ckpt_sock").glob(f"{self.run_id}*"):
            shutil.rmtree(p, ignore_errors=True)
        with contextlib.suppress(OSError):  # only when no other job's sockets are left in it
            os.rmdir("/tmp/ckpt_sock")
        os.close(self.events_fd)


def read_events(root: Path) -> list[dict]:
    path = root / "out" / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
