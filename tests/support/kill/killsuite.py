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
  newer; a kill in the middle of a push leaves the holder its previous replica, whole. With
  `netns` as well, the node and the holder are two network namespaces joined by veth links
  (netlab.py): the pushes and the pull cross the links.

Each restart is prepared ahead: the next generation of ranks and the next agent are started and
have imported everything; a go file releases them (killprocs.py). The checks and the record of a
kill are in killchecks.py, the holder's part in holderkill.py. Used by
tests/system/test_kill_suite.py and bench/kill_bench.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from faults import PLAN_FILE, Fired, Plan, write_json_atomic
from holderkill import replica_step, settled_replica_step
from killchecks import WORLD, KillResult, LatestWatch, memory_step, memory_steps, wait_for
from killprocs import NODE, Launcher, reap, replica_ring
from netlab import NetLab
from repo import pythonpath

from diag.agent.checkpoint.storage import MARKER_DIR
from diag.formats.snapshot import read_latest_step

TARGETS = ("trainer", "agent", "both", "node")
REPLICA_PERSIST_EVERY = 10


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
        netns: bool = False,
    ) -> None:
        if netns and not replicas:
            raise ValueError("netns runs the node and its replica's holder apart: replicas only")
        self.root = root
        self.zero = zero
        self.log = log
        self.job = f"kill-z{zero}"
        self.ctl = root / "ctl"
        self.save_dir = root / "ckpt"
        self.run_dir = Path(tempfile.mkdtemp(prefix="diag-kill-", dir="/dev/shm"))
        self.ctl.mkdir(parents=True, exist_ok=True)
        self.env = dict(
            os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1",
            PYTHONPATH=pythonpath(os.environ.get("PYTHONPATH", "")),
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
        # The holder of the node's replica: another node's agent, on loopback, or with `netns`
        # the node and the holder each in a network namespace (killprocs.py).
        self.replicas = replicas
        # With a replica the job persists rarely: what the replica saves over storage shows.
        self.persist_every = persist_every or (REPLICA_PERSIST_EVERY if replicas else 1)
        self.holder: subprocess.Popen | None = None
        self.holder_run = Path(tempfile.mkdtemp(prefix="diag-kill-h-", dir="/dev/shm"))
        self.lab = NetLab(2) if netns else None
        if replicas:
            self.env["DIAG_NODE"] = NODE  # the ranks' and the agent's node name
            self.env["DIAG_REPLICA_TOKEN"] = "kill-suite-replica-token"
        self.procs = Launcher(
            root, zero, self.job, self.persist_every, self.run_dir, self.holder_run, self.env,
            ring=replica_ring(self.lab) if replicas else "", lab=self.lab,
        )  # fmt: skip

    # -- processes --------------------------------------------------------------------------------

    def replica_step(self) -> int | None:
        """The step of the node's replica the holder holds complete, or None."""
        return replica_step(self.holder_run)

    def restores_logged(self) -> int:
        with contextlib.suppress(OSError):
            return (self.root / "agent.log").read_text(errors="replace").count("replica restore: ")
        return 0

    def _release_agent(self) -> None:
        assert self.next_agent is not None
        self.agent, self.next_agent = self.next_agent, None
        write_json_atomic(self.ctl / f"agent-go-{self.agent_gen}", "go")
        self.agent_gen += 1
        self.next_agent = self.procs.agent(self.agent_gen)

    def _release_ranks(self) -> None:
        self.ranks, self.next_ranks = self.next_ranks, []
        write_json_atomic(self.ctl / f"go-{self.gen}", str(self.ctl / f"store-{self.gen}"))
        self.gen += 1
        self.next_ranks = self.procs.ranks(self.gen)

    def start(self, warm_steps: int = 3) -> None:
        if self.lab is not None:
            self.lab.build()  # a half-built lab is torn down by close() too
        if self.replicas:
            self.holder = self.procs.holder()
        self.next_agent = self.procs.agent(0)
        self.next_ranks = self.procs.ranks(0)
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
            result.replica_at_kill = (
                settled_replica_step(self.holder_run, self.problems) if self.replicas else None
            )
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
        """Stops every process, then removes the run directories and the lab's namespaces."""
        try:
            (self.ctl / "stop").write_text("stop")
            self.watch.stop()
            for p in [*self.ranks, *self.next_ranks]:
                reap(p, 60)
            for p in (self.agent, self.next_agent, self.holder):
                if p is not None:
                    reap(p, 60, signal.SIGTERM)
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            shutil.rmtree(self.holder_run, ignore_errors=True)
            if self.lab is not None:
                self.lab.close()

    def leftovers(self) -> list[str]:
        """Temporary files in the save directory outside step directories and markers."""
        return [
            p.name
            for p in self.save_dir.iterdir()
            if p.name.startswith(".") and p.name != MARKER_DIR
        ]
