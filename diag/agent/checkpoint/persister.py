"""Persisting a rank's in-memory snapshot to storage: which snapshot, whether this node may
write it (a slot pulled from a peer's replica must not write into a directory that only the
replica names), one persist per rank at a time, and the record of what each rank has in storage.

Used by the manager's workers (a rank's request), and on failures (`persist_newest`: every
complete snapshot newer than storage, newest step first, before anything is stopped)."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diag.agent.checkpoint.persist import PersistResult, persist_slot
from diag.agent.checkpoint.pulled import PulledSlots, refusal
from diag.agent.checkpoint.sessions import RankKey
from diag.agent.checkpoint.storage import has_part
from diag.formats.slotfile import Snapshot, read_snapshots
from diag.formats.snapshot import find_slots, read_latest_step
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

INCIDENT_LOCK_TIMEOUT_S = 2.0  # a writer stuck mid-copy must not stall the incident path


@dataclass(frozen=True)
class CheckpointSettings:
    save_dir: Path | None = None  # overrides the save dir snapshots name (a different mount)
    keep_last: int = 3
    linger: float = 300.0
    workers: int = 2
    lock_timeout: float = 10.0
    persist_on_death: bool = True  # a registered rank that dies gets its snapshots persisted


class Persister:
    def __init__(
        self,
        run_dir: Path,
        job: str | None,
        options: CheckpointSettings,
        owners: Owners,
        named_save_dirs: Callable[[str], set[str]],
    ) -> None:
        self.run_dir = run_dir
        self.job = job
        self.options = options
        self.owners = owners
        self._named_save_dirs = named_save_dirs  # the save dirs this node's ranks registered with
        self._lock = threading.Lock()
        self._rank_locks: dict[RankKey, threading.Lock] = defaultdict(threading.Lock)
        self._persisted: dict[RankKey, PersistResult] = {}
        self.results: list[PersistResult] = []
        self.pulled = PulledSlots()  # slots installed from a peer's replica (agent.replication)

    def snapshots(self, job: str | None) -> list[Snapshot]:
        """Complete snapshots of `job` (or all jobs) in trusted slot files."""
        return read_snapshots(find_slots(self.run_dir, job), self.owners)

    def own_snapshots(self, job: str | None) -> list[Snapshot]:
        """`snapshots`, less the slots installed from a peer's replica that no rank rewrote."""
        return [s for s in self.snapshots(job) if not self.pulled.holds(s)]

    def own_save_dirs(self, job: str) -> set[str]:
        """The save directories this node's ranks of `job` name themselves: when they register,
        and in snapshots of their own."""
        return self._named_save_dirs(job) | {s.meta.save_dir for s in self.own_snapshots(job)}

    def persisted(self) -> tuple[dict[RankKey, PersistResult], list[PersistResult]]:
        """The newest persist of each rank, and the recent results (copies)."""
        with self._lock:
            return dict(self._persisted), list(self.results)

    def persist_rank(
        self, job: str, rank: int, step: int | None, lock_timeout: float | None = None
    ) -> PersistResult:
        """The rank's snapshot of `step` (its newest complete one when None) to storage."""
        key = RankKey(job, rank)
        with self._rank_locks[key]:
            snaps = sorted(
                (s for s in self.snapshots(job)
                 if s.meta.rank == rank and (step is None or s.meta.step == step)),
                key=lambda s: -s.meta.step,
            )  # fmt: skip
            if not snaps:
                return PersistResult(
                    job, rank, step or -1, "", False, f"step {step} is not in memory (overwritten?)"
                )
            snap = snaps[0]
            refused = None
            if self.options.save_dir is None and self.pulled.holds(snap):
                refused = refusal(snap.meta.save_dir, self.own_save_dirs(job))
            if refused is not None:
                result = PersistResult(job, rank, snap.meta.step, "", False, refused)
                self._record(result)
                return result
            result = persist_slot(
                snap.path,
                step=step,
                save_dir=self.options.save_dir,
                keep=self.options.keep_last,
                lock_timeout=self.options.lock_timeout if lock_timeout is None else lock_timeout,
                owners=self.owners,
            )
        self._record(result)
        return result

    def _record(self, result: PersistResult) -> None:
        with self._lock:
            self.results.append(result)
            del self.results[:-256]
            if result.ok:
                key = RankKey(result.job, result.rank)
                prev = self._persisted.get(key)
                if prev is None or result.step >= prev.step:
                    self._persisted[key] = result
        if result.ok and not result.skipped:
            log.info(
                "persisted %s rank %d step %d: %.1f MB in %.2f s%s",
                result.job, result.rank, result.step, result.nbytes / 1e6, result.seconds,
                " (committed)" if result.committed else "",
            )  # fmt: skip
        elif not result.ok:
            log.warning(
                "could not persist %s rank %d step %d: %s",
                result.job, result.rank, result.step, result.error,
            )  # fmt: skip

    def persist_newest(self, job: str, *, above_committed: bool = False) -> list[PersistResult]:
        """Persists, now, every complete snapshot of `job` newer than what storage holds for its
        rank, newest step first, the ranks of a step side by side (one thread per persist
        worker). Used on failures, before ranks are stopped. With `above_committed` (a drain,
        short of time) only steps newer than the committed one: once the newest step commits,
        the older snapshots are not written."""
        by_step: dict[int, list] = defaultdict(list)
        for snap in self.snapshots(job):
            by_step[snap.meta.step].append(snap)
        results: list[PersistResult] = []
        with ThreadPoolExecutor(max(1, self.options.workers), "diag-persist-now") as pool:
            for step in sorted(by_step, reverse=True):
                todo = []
                for snap in sorted(by_step[step], key=lambda s: s.meta.rank):
                    save_dir = self.options.save_dir or Path(snap.meta.save_dir)
                    if above_committed:
                        latest = read_latest_step(save_dir)
                        if latest is not None and step <= latest:
                            continue
                    if not has_part(save_dir, step, snap.meta.rank, snap.meta.run):
                        todo.append(snap.meta.rank)
                results += pool.map(
                    lambda rank, step=step: self.persist_rank(
                        job, rank, step, INCIDENT_LOCK_TIMEOUT_S
                    ),
                    todo,
                )
        return results
