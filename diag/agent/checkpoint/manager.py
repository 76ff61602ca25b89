"""The agent's checkpoint side: who is connected, what to persist, when to clean up.

- Ranks register over the control channel and keep a stream open; commands (flush, exit, dump)
  and persist acknowledgements are queued per rank and sent on that stream (`send_command` is the
  API the hang path and other parts of the agent use).
- Persist requests are served by worker threads; a failure (a rank died, a hang about to be acted
  on) persists synchronously, before anything is killed, every complete snapshot newer than
  storage, newest first (`persister.Persister`). Persisting also the older of a rank's two
  snapshots lets a step commit when another node's rank died in the middle of copying the newest.
- Every registered rank process is watched through a pidfd (`writers.WriterWatch`), journal or
  not: one that ends without closing its flash checkpointer (killed), or after an uncaught
  exception, gets the newest snapshots of its jobs persisted at once, as a failure would.
- Snapshots of a job whose writers are all gone are removed once nothing is left to persist:
  at once after a clean exit, after `linger` seconds after a failure (a restart loads them).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.agent.checkpoint.cleanup import removable, remove, slots_by_job, writer_alive
from diag.agent.checkpoint.persist import PersistResult
from diag.agent.checkpoint.persister import CheckpointSettings, Persister
from diag.agent.checkpoint.sessions import CommandReport, RankKey, Sessions
from diag.agent.checkpoint.stats import CheckpointStats, collect_stats
from diag.agent.checkpoint.writers import WatchOutcome, Writer, WriterWatch
from diag.agent.checkpoint.writingmark import WritingMarks
from diag.formats.journalmeta import safe_job_name
from diag.formats.slotfile import Snapshot, run_dir_owners
from diag.formats.snapshot import find_slots, read_latest_step
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

SCAN_INTERVAL_S = 2.0


@dataclass(frozen=True)
class _Job:
    job: str
    rank: int
    step: int | None
    save_dir: str
    reply: bool


class CheckpointManager:
    def __init__(
        self,
        run_dir: Path,
        job: str | None = None,
        options: CheckpointSettings | None = None,
        owners: Owners | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.job = job
        self.options = options or CheckpointSettings()
        # Who may write slots: root, the agent's user and the run directory's owner unless the
        # caller knows better (the trainer's user on a bare node).
        self.owners = owners if owners is not None else run_dir_owners(run_dir)
        self.sessions = Sessions()
        self.persister = Persister(run_dir, job, self.options, self.owners, self._registered_dirs)
        self.pulled = self.persister.pulled  # slots installed from a peer's replica
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._inflight: dict[str, int] = defaultdict(int)  # job -> queued or running persists
        self._dead_since: dict[str, float] = {}
        self._last_scan = 0.0
        self._warned_invisible: set[str] = set()
        # Called with the jobs whose ranks died or were stopped, once their own newest snapshots
        # are persisted (a holder then writes a lost peer's replica: agent.replication).
        self.stopped_hooks: list[Callable[[set[str]], None]] = []
        self.writing = WritingMarks(run_dir)  # ranks resuming from storage wait for these
        if job is not None:
            self.writing.clear_stale(job)  # a killed agent's
        self.writers = WriterWatch(self._writer_exited)
        self._workers = [
            threading.Thread(target=self._work, name=f"diag-persist-{i}", daemon=True)
            for i in range(max(1, self.options.workers))
        ]
        for t in self._workers:
            t.start()

    # -- ranks and commands (the API other parts of the agent use) ------------------------------

    def send_command(
        self, job: str, kind: int, ranks: list[int] | None = None, **kw: Any
    ) -> dict[int, str]:
        return self.sessions.send_command(job, kind, ranks, **kw)

    def wait_reports(self, ids: list[str], timeout: float) -> dict[str, CommandReport]:
        return self.sessions.wait_reports(ids, timeout)

    def connected(self, job: str) -> list[int]:
        return self.sessions.connected(job)

    def in_flight(self, job: str) -> int:
        """Persists of `job` queued or running (requests, and persists after a death)."""
        with self._lock:
            return self._inflight.get(job, 0)

    # -- rank processes ------------------------------------------------------------------------------

    def watch_writer(self, key: RankKey, pid: int, start_time: float, pid_ns: int) -> WatchOutcome:
        """Watches a rank process that registered (from the control channel's thread)."""
        outcome = self.writers.watch(pid, start_time, pid_ns, f"rank {key.rank} of {key.job}")
        if outcome == WatchOutcome.INVISIBLE and pid_ns and key.job not in self._warned_invisible:
            self._warned_invisible.add(key.job)
            log.warning(
                "rank %d of %s (pid %d) runs in another PID namespace: its death cannot be seen "
                "and its checkpoint is persisted only on request; share the PID namespace with "
                "the trainer (shareProcessNamespace: true)",
                key.rank, key.job, pid,
            )  # fmt: skip
        return outcome

    def _writer_exited(self, writer: Writer) -> None:
        """A registered rank process ended (on the watch's thread). Killed (its slots never
        closed) or failed: its jobs' newest snapshots go to storage now. A clean close asked for
        what it wanted persisted already."""
        mine = [
            f
            for files in slots_by_job(self.run_dir, self.job, self.owners).values()
            for f in files
            if f.writer_pid == writer.pid
            and (not writer.start_time or abs(f.writer_start - writer.start_time) <= 0.05)
        ]
        if not mine or all(h.closed for h in mine):
            log.debug("%s (pid %d) ended; nothing of it to persist", writer.label, writer.pid)
            return
        failed = any(h.failed for h in mine)
        how = "failed" if failed else "died"
        what = (
            "failed with an uncaught exception" if failed
            else "died without closing its flash checkpointer"
        )  # fmt: skip
        jobs = sorted({h.job for h in mine})
        if not self.options.persist_on_death:
            log.warning("%s (pid %d) %s; not persisting (--persist-on-incident false)",
                        writer.label, writer.pid, what)  # fmt: skip
            return
        log.warning(
            "%s (pid %d) %s: persisting the newest in-memory checkpoints of %s",
            writer.label, writer.pid, what, ", ".join(jobs),
        )  # fmt: skip
        with self._lock:
            for job in jobs:
                self._inflight[job] += 1  # the cleanup keeps its slots meanwhile
        t0 = time.monotonic()
        try:
            results = self.persist_all_jobs(set(jobs))
        finally:
            with self._lock:
                for job in jobs:
                    self._inflight[job] -= 1
        done = sorted({(r.job, r.step) for r in results if r.ok})
        log.log(
            logging.WARNING if results else logging.INFO,
            "persisted %d in-memory checkpoint part(s) in %.2f s after %s %s: %s",
            sum(r.ok for r in results), time.monotonic() - t0, writer.label, how,
            ", ".join(f"{j} step {s}" for j, s in done) or "nothing new",
        )  # fmt: skip

    # -- persisting ----------------------------------------------------------------------------------

    def request_persist(self, job: str, rank: int, step: int, save_dir: str) -> tuple[bool, str]:
        if self.job and job != self.job:
            return False, f"this agent watches job {self.job!r} only"
        with self._lock:
            self._inflight[job] += 1
        self._queue.put(_Job(job, rank, step, save_dir, reply=True))
        return True, ""

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                result = self.persister.persist_rank(item.job, item.rank, item.step)
                self._acknowledge(item, result)
            except Exception:
                log.exception("persist of %s rank %d failed", item.job, item.rank)
            finally:
                with self._lock:
                    self._inflight[item.job] -= 1

    @property
    def results(self) -> list[PersistResult]:
        return self.persister.results

    def snapshots(self, job: str | None) -> list[Snapshot]:
        return self.persister.snapshots(job)

    def own_snapshots(self, job: str | None) -> list[Snapshot]:
        return self.persister.own_snapshots(job)

    def persist_newest(self, job: str, *, above_committed: bool = False) -> list[PersistResult]:
        return self.persister.persist_newest(job, above_committed=above_committed)

    def _registered_dirs(self, job: str) -> set[str]:
        sessions = self.sessions.of_job(safe_job_name(job))  # keyed as the ranks register
        return {s.save_dir for s in sessions.values() if s.save_dir}

    def _acknowledge(self, item: _Job, result: PersistResult) -> None:
        from diag.proto import control_pb2 as pb

        ack = pb.PersistAck(
            step=item.step if item.step is not None else result.step, ok=result.ok,
            error=result.error, seconds=result.seconds, bytes=result.nbytes,
            committed=result.committed,
        )  # fmt: skip
        self.sessions.post(RankKey(item.job, item.rank), pb.AgentMessage(persist_ack=ack))
        if result.committed:
            # The commit completed by this rank's part is news for the other local ranks too.
            done = pb.PersistAck(step=result.step, ok=True, committed=True)
            for rank in self.sessions.of_job(item.job):
                if rank != item.rank:
                    self.sessions.post(RankKey(item.job, rank), pb.AgentMessage(persist_ack=done))

    def persist_newest_in_background(
        self,
        job: str,
        *,
        above_committed: bool = False,
        done: Callable[[list[PersistResult]], None] | None = None,
    ) -> threading.Thread:
        """`persist_newest` on a thread of its own, counted in `in_flight(job)` until it ends
        (a drain keeps watching its deadlines meanwhile)."""
        with self._lock:
            self._inflight[job] += 1

        def run() -> None:
            results: list[PersistResult] = []
            try:
                results = self.persist_newest(job, above_committed=above_committed)
            except Exception:
                log.exception("persist of the newest snapshots of %s failed", job)
            finally:
                with self._lock:
                    self._inflight[job] -= 1
            if done is not None:
                done(results)

        thread = threading.Thread(target=run, name="diag-persist-newest", daemon=True)
        thread.start()
        return thread

    def persist_all_jobs(self, jobs: set[str]) -> list[PersistResult]:
        """The newest snapshots of `jobs`, whose ranks died or are about to be stopped."""
        out = []
        for job in jobs:
            self.writing.take(job)
        try:
            for job in sorted(jobs):
                out += self.persist_newest(job)
            for hook in self.stopped_hooks:
                hook(jobs)  # a hook that writes on takes the mark before it is let go here
        finally:
            for job in jobs:
                self.writing.release(job)
        return out

    def jobs_in_run_dir(self) -> set[str]:
        from diag.formats.snapshot import parse_slot_name

        jobs = set()
        for p in find_slots(self.run_dir, self.job):
            name = parse_slot_name(p.name)
            if name is not None:
                jobs.add(name.job)
        return jobs

    # -- cleanup -----------------------------------------------------------------------------------

    def tick(self, now: float, *, final: bool = False) -> list[Path]:
        """Removes snapshots nobody needs any more; returns the files removed."""
        if not final and now - self._last_scan < SCAN_INTERVAL_S:
            return []
        self._last_scan = now
        removed = []
        for job, files in slots_by_job(self.run_dir, self.job, self.owners).items():
            # A connected rank counts as a live writer too (when the agent cannot see the
            # trainer's PIDs, e.g. without a shared PID namespace).
            if self.connected(job) or any(writer_alive(f) for f in files):
                self._dead_since.pop(job, None)
                continue
            since = self._dead_since.setdefault(job, now)
            with self._lock:
                busy = self._inflight.get(job, 0) > 0
            if not removable(files, busy=busy, dead_for=now - since, linger=self.options.linger,
                             final=final):  # fmt: skip
                continue
            removed += remove(files)
            self._dead_since.pop(job, None)
            log.info("removed %d snapshot slot(s) of job %s (no live writer)", len(files), job)
        return removed

    # -- facts -------------------------------------------------------------------------------------

    def stats(self) -> CheckpointStats:
        persisted, results = self.persister.persisted()
        return collect_stats(
            self.snapshots(self.job),
            persisted,
            results,
            lambda s: read_latest_step(self.options.save_dir or Path(s.meta.save_dir)),
        )

    def close(self, timeout: float = 60.0) -> None:
        """Finishes queued persists (up to `timeout` seconds), ends the workers and the streams."""
        deadline = time.monotonic() + timeout
        self.writers.close(timeout)  # a death's persist in progress finishes first
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        self.sessions.close()
