"""Carries out a drain (diag/agent/drain/plan.py decides): looks at the ranks, snapshots and storage, sends
EXIT over the control channel, persists, stops ranks that cannot reach a step boundary in time.

Runs on the agent's main loop, which does nothing else meanwhile; the control channel's server,
the persist workers and the watch on rank processes keep running on their own threads. A PERSIST
runs on a thread of its own (counted as a persist in flight), so the loop keeps watching the
deadlines while gigabytes go to storage.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.sessions import CommandKind
from diag.agent.checkpoint.storage import has_part, marker_path
from diag.agent.drain.plan import (
    ActionKind,
    DrainAction,
    DrainRequest,
    DrainSettings,
    DrainState,
    JobView,
    Phase,
    RankView,
    decide,
    start,
    tighten,
)
from diag.agent.observe.procs import same_process, stop_tree
from diag.agent.observe.rankproof import RankProver, claim_of, file_id
from diag.agent.observe.rundircheck import owners_of
from diag.formats import exitcodes
from diag.formats.journalmeta import journal_path
from diag.formats.snapshot import find_slots, parse_slot_name, read_latest_step

log = logging.getLogger(__name__)

TICK_S = 0.05
RATE_WINDOW = 16  # recent persists the storage rate is measured over


@dataclass
class _RankFacts:
    pid: int = 0
    start_time: float = 0.0
    streaming: bool = False
    save_dir: str = ""


class Drainer:
    def __init__(
        self,
        checkpoints: CheckpointManager,
        settings: DrainSettings,
        *,
        exit_code: int = exitcodes.RANK_DRAINED,
        prover: RankProver | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        # A PID from a session or a slot is stopped only once shown to be the rank's process.
        self.prover = prover or RankProver(owners_of(checkpoints.run_dir))
        self.settings = settings
        self.exit_code = exit_code
        self._commands: dict[tuple[str, int], str] = {}  # (job, rank) -> EXIT command id
        self.state: DrainState | None = None
        self._later: DrainRequest | None = None  # a request that came during the drain

    def tighten(self, request: DrainRequest) -> None:
        """A request during the drain (from a signal handler: only recorded here); the loop
        applies it at its next tick."""
        self._later = request

    # -- running -----------------------------------------------------------------------------

    def run(self, request: DrainRequest, abort: threading.Event | None = None) -> DrainState:
        """Drains until done, the deadline, or `abort` (a second SIGINT)."""
        self._commands = {}
        self._later = None
        now = time.monotonic()
        nbytes, rate = self._persist_estimate()
        state = start(
            request.reason, request.at, self.settings,
            deadline=self._deadline(request), persist_bytes=nbytes, persist_rate=rate,
        )  # fmt: skip
        log.warning(
            "drain (%s): EXIT to the ranks, then persist; ranks have until %.1f s, done by "
            "%.1f s from now (%.0f MB in memory, storage at %s)",
            request.reason, state.rank_deadline - now, state.deadline - now, nbytes / 1e6,
            f"{rate / 1e6:.0f} MB/s" if rate else "an assumed rate",
        )  # fmt: skip
        self.state = state
        while True:
            later, self._later = self._later, None
            if later is not None:
                state = self._tighten(state, later)
            now = time.monotonic()
            decision = decide(state, self.views(), now)
            for e in decision.events:
                log.log(logging.WARNING if e.warning else logging.INFO, "%s", e.message)
            for action in decision.actions:
                self.execute(action, decision.state)
            state = self.state = decision.state
            if state.phase == Phase.DONE:
                return state
            if abort is not None and abort.wait(TICK_S):
                log.warning("drain (%s) interrupted", request.reason)
                return state
            if abort is None:
                time.sleep(TICK_S)

    def _deadline(self, request: DrainRequest) -> float | None:
        return None if request.deadline is None else request.deadline - self.settings.margin

    def _tighten(self, state: DrainState, request: DrainRequest) -> DrainState:
        nbytes, rate = self._persist_estimate()
        new = tighten(
            state, request.reason, request.at, self.settings, deadline=self._deadline(request),
            persist_bytes=nbytes, persist_rate=rate,
        )  # fmt: skip
        now = time.monotonic()
        if new is state:
            log.info("drain (%s): %s changes nothing", state.reason, request.reason)
        else:
            log.warning(
                "drain: %s during the drain for %s: ranks now have until %.1f s, done by %.1f s "
                "from now",
                request.reason, state.reason, new.rank_deadline - now, new.deadline - now,
            )  # fmt: skip
        return new

    def execute(self, action: DrainAction, state: DrainState) -> None:
        cp = self.checkpoints
        if action.kind == ActionKind.SEND_EXIT:
            sent = cp.send_command(
                action.job, CommandKind.EXIT, list(action.ranks),
                reason=f"drain: {action.reason}", exit_code=self.exit_code,
            )  # fmt: skip
            for rank, cid in sent.items():
                self._commands[(action.job, rank)] = cid
            log.info("drain: EXIT sent to ranks %s of %s", sorted(sent), action.job)
        elif action.kind == ActionKind.PERSIST:
            t0 = time.monotonic()
            job = action.job

            def done(results: list) -> None:
                written = [r for r in results if r.ok and not r.skipped]
                failed = [r for r in results if not r.ok]
                if results:
                    log.log(
                        logging.WARNING if failed else logging.INFO,
                        "drain: persisted %d part(s) of %s in %.2f s (%s)%s",
                        len(written), job, time.monotonic() - t0,
                        ", ".join(sorted({f"step {r.step}" for r in written})) or "nothing new",
                        "; failed: " + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
                        if failed else "",
                    )  # fmt: skip

            cp.persist_newest_in_background(job, above_committed=True, done=done)
        elif action.kind == ActionKind.STOP_RANKS:
            grace = max(0.0, min(self.settings.stop_grace, state.deadline - time.monotonic() - 1))
            pids = self._pids(action.job, action.ranks)
            log.warning(
                "drain: stopping ranks %s of %s (pids %s): %s",
                list(action.ranks), action.job, sorted(pids.values()), action.reason,
            )  # fmt: skip
            threads = [
                threading.Thread(target=stop_tree, args=(pid, grace), daemon=True)
                for pid in pids.values()
            ]
            for t in threads:
                t.start()

    # -- looking -------------------------------------------------------------------------------

    def views(self) -> tuple[JobView, ...]:
        cp = self.checkpoints
        facts: dict[str, dict[int, _RankFacts]] = {}
        for job in cp.sessions.jobs():
            if cp.job and job != cp.job:
                continue
            for rank, s in cp.sessions.of_job(job).items():
                facts.setdefault(job, {})[rank] = _RankFacts(
                    s.pid, s.start_time, s.streaming, s.save_dir
                )
        snaps_by_job: dict[str, list] = {}
        for path in find_slots(cp.run_dir, cp.job):
            name = parse_slot_name(path.name)
            if name is not None:
                snaps_by_job.setdefault(name.job, [])
        for snap in cp.snapshots(cp.job):
            snaps_by_job.setdefault(snap.meta.job, []).append(snap)
            f = facts.setdefault(snap.meta.job, {}).setdefault(snap.meta.rank, _RankFacts())
            if not f.pid and not snap.header.closed:
                f.pid, f.start_time = snap.header.writer_pid, snap.header.writer_start
            f.save_dir = f.save_dir or snap.meta.save_dir
        reports = cp.wait_reports(list(self._commands.values()), 0)
        out = []
        for job in sorted(set(facts) | set(snaps_by_job)):
            save_dir = self._save_dir(facts.get(job, {}))
            committed = read_latest_step(save_dir) if save_dir else None
            ranks = []
            for rank, f in sorted(facts.get(job, {}).items()):
                cid = self._commands.get((job, rank))
                rep = reports.get(cid) if cid else None
                reported = rep.step if rep is not None and rep.ok and rep.step >= 0 else None
                persisted = None
                if (
                    reported is not None
                    and save_dir
                    and (marker_path(save_dir, reported, rank).exists())
                ):
                    persisted = reported
                alive = f.streaming or (f.pid > 0 and same_process(f.pid, f.start_time))
                ranks.append(RankView(rank, alive, f.streaming, reported, persisted))
            newest, nbytes = None, 0
            floor = committed if committed is not None else -1
            for snap in snaps_by_job.get(job, []):
                target = Path(cp.options.save_dir or snap.meta.save_dir)
                if snap.meta.step <= floor or has_part(
                    target, snap.meta.step, snap.meta.rank, snap.meta.run
                ):
                    continue
                newest = max(newest if newest is not None else -1, snap.meta.step)
                nbytes += snap.meta.nbytes
            out.append(
                JobView(
                    job, tuple(ranks), in_flight=cp.in_flight(job), newest_unpersisted=newest,
                    unpersisted_bytes=nbytes, committed=committed,
                )
            )  # fmt: skip
        return tuple(out)

    def _save_dir(self, facts: dict[int, _RankFacts]) -> Path | None:
        if self.checkpoints.options.save_dir is not None:
            return self.checkpoints.options.save_dir
        for f in facts.values():
            if f.save_dir:
                return Path(f.save_dir)
        return None

    def _pids(self, job: str, ranks: tuple[int, ...]) -> dict[int, int]:
        """PIDs of the ranks' processes, each shown to map or hold its journal or a slot."""
        out: dict[int, int] = {}
        run_dir = self.checkpoints.run_dir
        slots = find_slots(run_dir, job)

        def proven(rank: int, pid: int, start: float) -> bool:
            named = [p for p in slots if (n := parse_slot_name(p.name)) and n.rank == rank]
            files = [file_id(journal_path(run_dir, job, rank)), *map(file_id, named)]
            proof = self.prover.check(claim_of(pid, start, files))
            if not proof and proof.exists:
                log.warning("drain: not stopping rank %d of %s: %s", rank, job, proof.reason)
            return proof.ok

        for rank, s in self.checkpoints.sessions.of_job(job).items():
            if rank in ranks and s.pid > 0 and s.start_time and proven(rank, s.pid, s.start_time):
                out[rank] = s.pid
        for snap in self.checkpoints.snapshots(job):
            r, h = snap.meta.rank, snap.header
            if r in ranks and r not in out and proven(r, h.writer_pid, h.writer_start):
                out[r] = h.writer_pid
        return out

    def _persist_estimate(self) -> tuple[int, float | None]:
        """Bytes of the newest snapshot of every local rank, and the storage rate measured by
        recent persists (None before any)."""
        cp = self.checkpoints
        newest: dict[tuple[str, int], int] = {}
        steps: dict[tuple[str, int], int] = {}
        for s in cp.snapshots(cp.job):
            key = (s.meta.job, s.meta.rank)
            if s.meta.step > steps.get(key, -1):
                steps[key], newest[key] = s.meta.step, s.meta.nbytes
        recent = [r for r in cp.results[-RATE_WINDOW:] if r.ok and not r.skipped and r.seconds > 0]
        rate = sum(r.nbytes for r in recent) / sum(r.seconds for r in recent) if recent else None
        return sum(newest.values()), rate
