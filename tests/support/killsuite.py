"""The kill suite: a real 2-rank DeepSpeed job (gloo, CPU) that flash-checkpoints every step and a
real `diag agent` persisting each step; the trainer ranks, the agent or both are SIGKILLed at a
chosen instant of save, copy, persist, commit or (with replicas) the node's push of its replica
to its holder (faults.py), restarted, and checked:

- `latest` never names an incomplete step (every rank's marker and files there, sizes as marked)
  and never moves backwards (a watcher thread reads it every few milliseconds, and after each
  kill);
- the ranks hold the same steps in memory (saves are all or none), but for the one being copied;
- after a trainer kill the step restored is not older than the newest step every rank held
  complete in memory, or that `latest` named, at the kill; the steps trained again after it give
  the same losses to the bit (a torn or mixed restore would not);
- after an agent kill, the restarted agent commits a step newer than what memory held at the kill;
- a node kill (ranks and agent, and the node's shared memory lost with it, as when a node dies and
  the job comes back elsewhere) restores from storage, never older than what `latest` named at
  the kill; with `replicas`, a second agent on this machine stands in for the next node of the
  ring and holds the node's replica, and the job persists to storage only every
  `persist_every`th step (storage lags memory): the node's ranks restore exactly the replica the
  holder held whole at the kill (pulled back by the new agent), or the step `latest` named when
  newer; a kill in the middle of a push leaves the holder its previous replica, whole.

Each restart is prepared ahead: the next generation of ranks and the next agent are started and
have imported everything; a go file releases them. Used by tests/system/test_kill_suite.py and
bench/kill_bench.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from faults import PLAN_FILE, Fired, Plan, write_json_atomic

from diag.agent.checkpoint.storage import MARKER_DIR, marker_path
from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import find_slots, read_latest_step, step_tag

TESTS = Path(__file__).parent
WORLD = 2
TARGETS = ("trainer", "agent", "both", "node")
REPLICA_PERSIST_EVERY = 10
HOLDER_NODE, NODE = "node-b", "node-a"


def wait_for(pred: Callable[[], object], timeout: float, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return bool(pred())


@dataclass
class KillResult:
    zero: int
    target: str
    planned: str
    phase: str  # where the firing thread was at the kill
    mode: str
    latest_at_kill: int | None
    memory_at_kill: int | None  # newest step every rank held complete in shared memory
    trained_at_kill: int  # newest step whose loss was logged
    restored: int | None = None  # the step the relaunched trainer loaded
    source: str = ""
    committed_after: int | None = None  # agent kills: the step the restarted agent committed
    memory_by_rank: dict[int, list[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    memory_lost: bool = False  # a node kill: the node's shared memory went with it
    replica_at_kill: int | None = None  # the step the holder held for the node at the kill
    fired_step: int = -1  # the step of the phase the kill fired in (a push: the step sent)
    fired_tick: int = 0  # the sub-operations of the phase done at the kill (a push: 2 + parts)
    replica_after: int | None = None  # holder kills: the step the restarted holder took

    @property
    def restored_minus_replica(self) -> int | None:
        if self.restored is None or self.replica_at_kill is None:
            return None
        return self.restored - self.replica_at_kill

    @property
    def restored_minus_memory(self) -> int | None:
        """0: the newest step the node held; -1: the step in flight to the holder was lost."""
        if self.restored is None or self.memory_at_kill is None:
            return None
        return self.restored - self.memory_at_kill

    @property
    def bound(self) -> int | None:
        memory = None if self.memory_lost else self.memory_at_kill
        known = [s for s in (self.latest_at_kill, memory, self.replica_at_kill) if s is not None]
        return max(known) if known else None


class LatestWatch:
    """Reads `latest` every few milliseconds: never backwards, never an incomplete step.

    `check` runs on the watch's thread and on the suite's after each kill: one lock orders the
    two, a read and what is concluded from it together. Unordered, a read of step N that lost the
    processor before its comparison while the other thread read N+1 (just committed) and raised
    `highest` reported "latest moved backwards: N+1 -> N" on a `latest` that only moved forward."""

    def __init__(self, save_dir: Path, zero: int) -> None:
        self.save_dir = save_dir
        self.zero = zero
        self.problems: list[str] = []
        self.seen: list[int] = []
        self.highest: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latest-watch", daemon=True)

    def start(self) -> LatestWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def check(self) -> int | None:
        with self._lock:
            return self._check()

    def take_problems(self) -> list[str]:
        """The problems seen so far, cleared (those of one kill)."""
        with self._lock:
            out, self.problems = self.problems, []
            return out

    def _check(self) -> int | None:
        step = read_latest_step(self.save_dir)
        if step is None:
            if self.highest is not None:
                self.problems.append(f"latest vanished after naming step {self.highest}")
            return None
        if self.highest is not None and step < self.highest:
            self.problems.append(f"latest moved backwards: {self.highest} -> {step}")
        if self.highest is None or step > self.highest:
            self.highest = step
            self.seen.append(step)
            missing = incomplete(self.save_dir, step, self.zero)
            # A newer commit may prune this step meanwhile: only a step still named counts.
            if missing and read_latest_step(self.save_dir) == step:
                self.problems.append(f"latest names step {step}, incomplete: {missing}")
        return step

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            with contextlib.suppress(OSError, ValueError):
                self.check()


def incomplete(save_dir: Path, step: int, zero: int) -> str:
    """What is missing for DeepSpeed to load `step` from `save_dir` ("" when nothing)."""
    files: set[str] = set()
    runs: set[str] = set()
    for rank in range(WORLD):
        try:
            doc = json.loads(marker_path(save_dir, step, rank).read_text())
        except (OSError, ValueError) as e:
            return f"rank {rank}'s marker: {e}"
        size = 0
        for name in doc["files"]:
            try:
                size += (save_dir / name).stat().st_size
            except OSError as e:
                return f"{name}: {e}"
        if size != doc["bytes"]:
            return f"rank {rank}'s files hold {size} bytes, its marker says {doc['bytes']}"
        files.update(doc["files"])
        runs.add(str(doc.get("run", "")))
    if len(runs) > 1:
        return f"parts from different launches of the trainer: {sorted(runs)}"
    tag = step_tag(step)
    model = (
        {f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(WORLD)}
        if zero == 3
        else {f"{tag}/mp_rank_00_model_states.pt"}
    )
    optim = {f"{tag}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)}
    lacking = (model | optim) - files
    return f"not written: {sorted(lacking)}" if lacking else ""


def memory_steps(run_dir: Path, job: str) -> dict[int, list[int]]:
    """Rank -> the steps it holds complete in shared memory."""
    by_rank: dict[int, list[int]] = {}
    for snap in read_snapshots(find_slots(run_dir, job)):
        by_rank.setdefault(snap.meta.rank, []).append(snap.meta.step)
    return {r: sorted(s) for r, s in sorted(by_rank.items())}


def memory_step(by_rank: dict[int, list[int]]) -> int | None:
    """The newest step every rank holds complete in shared memory."""
    if len(by_rank) < WORLD:
        return None
    common = set.intersection(*(set(s) for s in by_rank.values()))
    return max(common) if common else None


class KillSuite:
    """One ZeRO stage: one long job, its agent, and kills one after another."""

    def __init__(
        self,
        root: Path,
        zero: int,
        *,
        log: Callable[[str], None] = print,
        replicas: bool = False,
        persist_every: int | None = None,
    ) -> None:
        self.root = root
        self.zero = zero
        self.log = log
        self.job = f"kill-z{zero}"
        self.ctl = root / "ctl"
        self.save_dir = root / "ckpt"
        self.timeline = root / "timeline"
        self.run_dir = Path(tempfile.mkdtemp(prefix="diag-kill-", dir="/dev/shm"))
        self.ctl.mkdir(parents=True, exist_ok=True)
        self.env = dict(
            os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        )  # fmt: skip
        self.gen = 0
        self.agent_gen = 0
        self.ranks: list[subprocess.Popen] = []
        self.next_ranks: list[subprocess.Popen] = []
        self.agent: subprocess.Popen | None = None
        self.next_agent: subprocess.Popen | None = None
        self.plan_id = 0
        self.losses: dict[int, str] = {}
        self._loss_pos: dict[int, int] = {}
        self.problems: list[str] = []
        self.watch = LatestWatch(self.save_dir, zero)
        self.results: list[KillResult] = []
        # The holder of the node's replica: another node's agent, here on loopback.
        self.replicas = replicas
        # With a replica the job persists rarely: what the replica saves over storage shows.
        self.persist_every = persist_every or (REPLICA_PERSIST_EVERY if replicas else 1)
        self.holder: subprocess.Popen | None = None
        self.holder_run = Path(tempfile.mkdtemp(prefix="diag-kill-h-", dir="/dev/shm"))
        if replicas:
            from jobrun import free_port

            self.env["DIAG_NODE"] = NODE  # the ranks' and the agent's node name
            self.env["DIAG_REPLICA_TOKEN"] = "kill-suite"
            self.ring = f"{NODE}=127.0.0.1:{free_port()},{HOLDER_NODE}=127.0.0.1:{free_port()}"

    # -- processes --------------------------------------------------------------------------------

    def _spawn_ranks(self, gen: int) -> list[subprocess.Popen]:
        procs = []
        for rank in range(WORLD):
            env = dict(
                self.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                LOCAL_WORLD_SIZE=str(WORLD),
            )  # fmt: skip
            cmd = [
                sys.executable, str(TESTS / "kill_job.py"), "--zero", str(self.zero),
                "--job", self.job, "--save-dir", str(self.save_dir), "--ctl", str(self.ctl),
                "--gen", str(gen), "--persist-every", str(self.persist_every),
            ]  # fmt: skip
            with open(self.root / f"ranks-{gen}.log", "ab") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        return procs

    def _spawn_agent(self, gen: int) -> subprocess.Popen:
        cmd = [
            sys.executable, str(TESTS / "fault_agent.py"), "--ctl", str(self.ctl),
            "--go", str(self.ctl / f"agent-go-{gen}"), "--", "agent",
            "--run-dir", str(self.run_dir), "--job", self.job, "--timeline", str(self.timeline),
            "--native-stacks", "false", "--interval", "0.5", "--keep-last", "3", "-v",
        ]  # fmt: skip
        if self.replicas:
            cmd += ["--replica-nodes", self.ring, "--replica-interval", "0.05"]
        with open(self.root / "agent.log", "ab") as out:
            return subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def spawn_holder(self) -> subprocess.Popen:
        go = self.ctl / "holder-go"  # the holder starts at once
        go.touch()
        cmd = [
            sys.executable, str(TESTS / "fault_agent.py"), "--ctl", str(self.ctl), "--go", str(go),
            "--", "agent", "--run-dir", str(self.holder_run),
            "--job", self.job, "--node", HOLDER_NODE, "--timeline", str(self.timeline),
            "--native-stacks", "false", "--replica-nodes", self.ring, "-v",
        ]  # fmt: skip
        env = dict(self.env, DIAG_RUN_DIR=str(self.holder_run), DIAG_NODE=HOLDER_NODE)
        with open(self.root / "holder.log", "ab") as out:
            return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def replica_step(self) -> int | None:
        """The step of the node's replica the holder holds complete, or None."""
        steps = [
            int(p.name.split("-")[-2])
            for p in (self.holder_run / ".replicas").glob(f"{NODE}-*-*")
            if (p / "replica.json").exists()
        ]
        return max(steps, default=None)

    def settled_replica_step(self) -> int | None:
        """The replica step once the holder has finished or dropped a push the kill cut: the
        parts already in its socket may still complete it, or the cut removes the staging."""
        arriving = lambda: list((self.holder_run / ".replicas").glob(f".in-{NODE}-*"))  # noqa: E731
        if not wait_for(lambda: not arriving(), 60):
            self.problems.append(f"the holder kept a half-received replica: {arriving()}")
        return self.replica_step()

    def restores_logged(self) -> int:
        with contextlib.suppress(OSError):
            return (self.root / "agent.log").read_text(errors="replace").count("replica restore: ")
        return 0

    def _release_agent(self) -> None:
        assert self.next_agent is not None
        self.agent, self.next_agent = self.next_agent, None
        write_json_atomic(self.ctl / f"agent-go-{self.agent_gen}", "go")
        self.agent_gen += 1
        self.next_agent = self._spawn_agent(self.agent_gen)

    def _release_ranks(self) -> None:
        self.ranks, self.next_ranks = self.next_ranks, []
        write_json_atomic(self.ctl / f"go-{self.gen}", str(self.ctl / f"store-{self.gen}"))
        self.gen += 1
        self.next_ranks = self._spawn_ranks(self.gen)

    def start(self, warm_steps: int = 3) -> None:
        if self.replicas:
            self.holder = self.spawn_holder()
        self.next_agent = self._spawn_agent(0)
        self.next_ranks = self._spawn_ranks(0)
        self._release_agent()
        self._release_ranks()
        self.watch.start()
        self._steady(0, warm_steps, timeout=900)

    def _steady(self, since: int, steps: int, timeout: float) -> None:
        """Waits until the running generation trained `steps` steps past `since` and storage
        committed one of them."""

        def ready() -> bool:
            self._read_losses()
            latest = read_latest_step(self.save_dir) or 0
            done = max(self.gen_steps(self.gen - 1), default=0)
            # With replicas storage lags: a replica newer than `since` is progress as well.
            replica = (self.replica_step() or 0) if self.replicas else 0
            return done >= since + steps and max(latest, replica) > since

        if not wait_for(ready, timeout, every=0.05):
            raise RuntimeError(
                f"ZeRO-{self.zero}: the job made no progress past step {since} in {timeout:.0f} s "
                f"(latest={read_latest_step(self.save_dir)})\n{self.tail()}"
            )

    def gen_steps(self, gen: int) -> list[int]:
        path = self.ctl / f"loss-{gen}.jsonl"
        with contextlib.suppress(FileNotFoundError):
            return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")]
        return []

    def _read_losses(self) -> None:
        """Adds every generation's logged losses; a step logged twice must match."""
        for gen in range(self.gen):
            path = self.ctl / f"loss-{gen}.jsonl"
            try:
                with open(path) as f:
                    f.seek(self._loss_pos.get(gen, 0))
                    data = f.read()
            except FileNotFoundError:
                continue
            lines = data.split("\n")
            complete, rest = lines[:-1], lines[-1]
            self._loss_pos[gen] = self._loss_pos.get(gen, 0) + len(data) - len(rest)
            for line in complete:
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue  # a line cut by the kill
                step, loss = doc["step"], doc["loss"]
                old = self.losses.setdefault(step, loss)
                if old != loss:
                    self.problems.append(
                        f"step {step} trained again (generation {gen}) gives loss {loss}, "
                        f"before {old}: the restored state differs"
                    )

    def tail(self) -> str:
        out = []
        for name in ("agent.log", f"ranks-{max(self.gen - 1, 0)}.log"):
            with contextlib.suppress(OSError):
                out.append(f"--- {name}\n" + (self.root / name).read_text(errors="replace")[-3000:])
        return "\n".join(out)

    # -- one kill ---------------------------------------------------------------------------------

    def fire(self, phase: str, pids: list[int], mode: str, fraction: float) -> Fired:
        """Publishes a plan and waits for it to fire."""
        self.plan_id += 1
        plan = Plan(self.plan_id, phase, tuple(pids), mode, fraction)
        write_json_atomic(self.ctl / PLAN_FILE, plan.to_json())
        fired_path = self.ctl / f"fired-{plan.id}.json"
        if not wait_for(fired_path.exists, 8):
            # A phase shorter than the timers' reach: kill at its sub-operations instead.
            plan = Plan(plan.id, phase, plan.pids, "tick", fraction)
            write_json_atomic(self.ctl / PLAN_FILE, plan.to_json())
            if not wait_for(fired_path.exists, 60):
                raise RuntimeError(f"no {phase} phase in 68 s\n{self.tail()}")
        return Fired.load(fired_path)

    def kill(self, target: str, phase: str, mode: str, fraction: float) -> KillResult:
        t0 = time.monotonic()
        assert self.agent is not None
        rank_pids = [p.pid for p in self.ranks]
        if target not in TARGETS:
            raise ValueError(f"unknown kill target {target!r}: one of {', '.join(TARGETS)}")
        pids = {"trainer": rank_pids, "agent": [self.agent.pid]}.get(
            target, [*rank_pids, self.agent.pid]
        )
        fired = self.fire(phase, pids, mode, fraction)
        killed_ranks = target in ("trainer", "both", "node")
        killed_agent = target in ("agent", "both", "node")
        procs = (self.ranks if killed_ranks else []) + ([self.agent] if killed_agent else [])
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                self.problems.append(f"pid {p.pid} outlived its SIGKILL")
        # Dead writers cannot change their slots: this is memory as it was at the kill. Latest
        # may only have moved forward since (the agent persisting the dead ranks' snapshots).
        self._read_losses()
        held = memory_steps(self.run_dir, self.job)
        result = KillResult(
            self.zero, target, phase, fired.phase, fired.mode,
            latest_at_kill=read_latest_step(self.save_dir),
            memory_at_kill=memory_step(held),
            trained_at_kill=max(self.gen_steps(self.gen - 1), default=0),
            memory_by_rank=held, fired_step=fired.step, fired_tick=fired.tick,
        )  # fmt: skip
        newest = [max(steps) for steps in held.values()]
        if killed_ranks and len(newest) == WORLD and result.memory_at_kill != min(newest):
            # Saves are collective: a rank's newest step is held by every rank, except the one
            # step a rank may have finished copying before the other was killed copying it.
            result.problems.append(f"the ranks hold different steps in memory: {held}")
        if target == "node":
            result.replica_at_kill = self.settled_replica_step() if self.replicas else None
            if self.replicas and result.replica_at_kill is None:
                result.problems.append("the holder held no whole replica of the node at the kill")
            self._lose_memory()
            result.memory_lost = True
        restores = self.restores_logged()
        if killed_agent:
            self._release_agent()
        if killed_ranks:
            # The replacement node's ranks start once its agent has pulled the replica (a
            # trainer container started after its sidecar is ready).
            pulled = lambda: self.restores_logged() > restores  # noqa: E731
            if self.replicas and killed_agent and not wait_for(pulled, 300, every=0.05):
                raise RuntimeError(f"the new agent chose no restore\n{self.tail()}")
            self._release_ranks()
            start = self.ctl / f"start-{self.gen - 1}.json"
            if not wait_for(start.exists, 600, every=0.05):
                raise RuntimeError(f"generation {self.gen - 1} never loaded\n{self.tail()}")
            doc = json.loads(start.read_text())
            result.restored, result.source = doc["step"], doc["from"]
            # Memory from the replica, unless storage names a newer step (it wins then).
            replica, latest = result.replica_at_kill, result.latest_at_kill
            want = "memory" if replica is not None and replica >= (latest or 0) else "storage"
            if result.memory_lost and result.restored and result.source != want:
                result.problems.append(
                    f"step {result.restored} restored from {result.source!r} after the node's "
                    f"memory was lost (replica held: {result.replica_at_kill}), not from {want}"
                )
            if self.replicas and result.memory_lost:
                # Exactly the replica held whole, or storage's newer step: never older, and
                # never a newer step than one held whole anywhere.
                expect = max(replica or 0, latest or 0)
                if result.restored != expect:
                    result.problems.append(
                        f"restored step {result.restored} ({result.source}), not step {expect} "
                        f"(replica held {replica}, latest {latest})"
                    )
            bound = result.bound
            if bound is not None and (result.restored or 0) < bound:
                result.problems.append(
                    f"restored step {result.restored} ({result.source}) is older than step "
                    f"{bound} (memory {result.memory_at_kill}, latest {result.latest_at_kill})"
                )
            self._steady(result.restored or 0, 2, timeout=600)
        else:
            # The trainer kept running: the new agent must commit something newer than memory
            # held at the kill (the trainer's pending persists reach it on reconnect).
            want = max(result.memory_at_kill or 0, result.latest_at_kill or 0)
            if not wait_for(lambda: (read_latest_step(self.save_dir) or 0) > want, 300, 0.05):
                result.problems.append(
                    f"the restarted agent committed nothing newer than step {want} in 300 s"
                )
            result.committed_after = read_latest_step(self.save_dir)
            self._steady(result.trained_at_kill, 1, timeout=300)
        self.watch.check()
        result.problems += self.watch.take_problems() + self.problems
        self.problems.clear()
        result.seconds = time.monotonic() - t0
        self.results.append(result)
        return result

    def _lose_memory(self) -> None:
        """The node's shared memory goes with the node: every slot and journal of the run
        directory (the ranks and agent started next, waiting for their go file, open theirs
        only once released)."""
        for p in self.run_dir.iterdir():
            if p.is_file() or p.is_symlink():
                p.unlink(missing_ok=True)

    # -- the end ----------------------------------------------------------------------------------

    def close(self) -> None:
        (self.ctl / "stop").write_text("stop")
        self.watch.stop()
        for p in [*self.ranks, *self.next_ranks]:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for p in (self.agent, self.next_agent, self.holder):
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.holder_run, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Temporary files in the save directory outside step directories and markers."""
        return [
            p.name
            for p in self.save_dir.iterdir()
            if p.name.startswith(".") and p.name != MARKER_DIR
        ]
