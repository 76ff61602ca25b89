"""The kill suite's checks and records (killsuite.py): what one kill gave (KillResult), the watch of
`latest` (never backwards, never an incomplete step), what a step needs in storage to load, and
the steps the ranks hold complete in shared memory."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from diag.agent.checkpoint.storage import marker_path
from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import find_slots, read_latest_step, step_tag

WORLD = 2


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
        if self._thread.ident is not None:  # started (a suite may end before its start did)
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
