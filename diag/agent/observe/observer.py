"""Turns the journals in the run directory into an Observation for the decision core.

Reads incrementally (ranktracker.py): each poll decodes only the records written since the last
one, plus the slots of ops still pending. Journals and metas are input from another process:
those not owned by a trainer, not regular files, or malformed are skipped with one warning each,
and a meta's PID is believed only once the process is shown to be the journal's writer
(rankproof.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path

from diag.agent.detect.cadence import fold
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.observe.procs import ProcessWatch, ProcInfo
from diag.agent.observe.rankproof import RankClaim, RankProof, RankProver, claim_of
from diag.agent.observe.ranktracker import RankTracker
from diag.agent.observe.rundircheck import owners_of
from diag.formats.journal import CloseReason, JournalFormatError, JournalStatus
from diag.formats.journalmeta import JOURNAL_SUFFIX, JournalMeta, meta_path_for, read_meta
from diag.formats.journalreader import JournalReader
from diag.formats.rundir import pid_namespace
from diag.formats.untrusted import Owners, UntrustedInput
from diag.formats.worlds import world_of

log = logging.getLogger(__name__)

_NS = 1e-9
_LEFTOVER_IDLE_S = 600.0  # an unseen writer this idle before we started is a leftover
ENDED_LINGER_S = 60.0  # how long a rank whose process ended stays in view


class Observer:
    """Owns the journal readers and the process watch of one agent."""

    def __init__(
        self,
        run_dir: Path,
        job: str | None = None,
        warmup_cadence: float = 30.0,
        owners: Owners | None = None,
        agent_pids: frozenset[int] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.job = job
        self.warmup_cadence = warmup_cadence  # seconds of steady pace (cadence.py)
        # Whose journals and metas are read, and as whom a rank may run (rundircheck.py).
        self.owners = owners if owners is not None else owners_of(run_dir)
        self.procs = ProcessWatch()
        self.trackers: dict[Path, RankTracker] = {}
        self._stale: set[tuple[Path, tuple[int, int]]] = set()
        # Files refused, by what they were when refused: warned about once, not read again
        # until replaced.
        self._refused: dict[Path, tuple[int, ...]] = {}
        self._warned_invisible: set[int] = set()
        self._started = time.monotonic()
        self._pid_ns = pid_namespace()
        # Never a rank: this process and its descendants (by default), and whichever other
        # processes of the agent's the caller names.
        self.prover = RankProver(self.owners, self._pid_ns, agent_pids)
        self._ns_shared = False  # seen a trainer PID: we share its PID namespace
        self._unsure: set[Path] = set()  # invisible PIDs of journals that do not name their ns

    def discover(self) -> None:
        if not self.run_dir.is_dir():
            return
        new = []
        for path in self.run_dir.glob(f"*{JOURNAL_SUFFIX}"):
            t = self.trackers.get(path)
            if t is not None and not t.reader.replaced():
                continue
            if t is not None:
                self._drop(path)
            new.append(path)
        if new and not self._ns_shared:
            # Journals without the writer's namespace (older trainers): one live writer we can
            # see proves the namespace is shared; from then on a PID we cannot see is gone.
            for path in new:
                with contextlib.suppress(OSError, ValueError):
                    meta = read_meta(path, self.owners)
                    journal = _file_id(path)
                    if meta.pid_ns == 0 and journal is not None and self._proves(meta, journal):
                        self._ns_shared = True
                        break
        for path in new:
            self._open(path)
        if self._ns_shared and self._unsure:
            self._judge_unsure()

    def _refuse(self, path: Path, ident: tuple[int, ...], problem: str) -> None:
        """One warning per refused file (not one per poll); it is not read again until it
        changes."""
        self._refused[path] = ident
        log.warning("ignoring %s", problem)

    def _proves(self, meta: JournalMeta, journal: tuple[int, int]) -> RankProof:
        return self.prover.check(_claim(meta, journal))

    def claim(self, t: RankTracker) -> RankClaim:
        """What the tracker's meta claims of its writer: what a dump helper proves again."""
        return _claim(t.meta, t.reader.inode)

    def proof(self, t: RankTracker) -> RankProof:
        """Whether the tracker's PID is, now, its rank's process: asked before acting on it."""
        if not t.proven:
            return RankProof(False, f"PID {t.meta.pid} was never shown to be rank {t.rank}")
        return self._proves(t.meta, t.reader.inode)

    def _open(self, path: Path) -> None:
        ident = _ident(path, changes=False)
        if ident is None or self._refused.get(path) == ident:
            return
        try:
            reader = JournalReader(path, owners=self.owners)
        except JournalFormatError as e:
            self._refuse(path, ident, str(e))
            return
        key = (path, reader.inode)
        if key in self._stale:
            reader.close()
            return
        meta_path = meta_path_for(path)
        meta_ident = _ident(meta_path, changes=True)
        if meta_ident is None or self._refused.get(meta_path) == meta_ident:
            reader.close()  # no meta yet (the writer makes it after the journal), or a bad one
            return
        try:
            meta = read_meta(path, self.owners)
        except UntrustedInput as e:
            reader.close()
            self._refuse(meta_path, meta_ident, f"{e} (the journal {path.name} is not read)")
            return
        except OSError as e:
            log.debug("journal %s has no readable meta yet (%s)", path, e)
            reader.close()
            return
        if self.job and meta.job != self.job:
            reader.close()
            self._stale.add(key)
            return
        proven = False
        if not meta.pid_ns or meta.pid_ns == self._pid_ns:
            proof = self._proves(meta, reader.inode)
            if not proof and proof.exists:
                # A live process that is not the writer: the meta lies (or names a process
                # that took the PID over). Not a rank: never watched, dumped or signalled.
                reader.close()
                self._refuse(
                    meta_path, meta_ident,
                    f"{meta_path}: the process it names is not the writer of {path.name} "
                    f"({proof.reason}); its journal is not watched",
                )  # fmt: skip
                return
            proven = proof.ok
        info = (
            self.procs.watch(meta.pid, meta.pid_start_time)
            if proven
            else self.procs.unseen(meta.pid)
        )
        gone = False
        if not info.visible:
            status = reader.state().status
            created = reader.header.created_mono_ns * _NS
            shared = self._shares_namespace(meta)
            # Left by a process that ended before we started (or, when we cannot tell whether
            # its PID is ours to see, by one long idle), or one that finished cleanly: not ours
            # to judge. One that failed since we started is judged like a death.
            oldest = self._started if shared else self._started - _LEFTOVER_IDLE_S
            ended = status == JournalStatus.CLOSED or (
                status == JournalStatus.FAILED and not shared
            )
            if ended or created < oldest:
                reader.close()
                self._stale.add(key)
                self.procs.forget(meta.pid)
                return
            # Same namespace: made since we started and already gone, it died before we first
            # looked (a rank killed early). Otherwise we cannot watch it: say what to change.
            gone = bool(shared)
            if shared is None:
                self._unsure.add(path)
            if not shared and meta.pid not in self._warned_invisible:
                self._warned_invisible.add(meta.pid)
                log.warning(
                    "rank %d: PID %d is not visible to the agent; share the PID namespace with "
                    "the trainer (shareProcessNamespace: true) for liveness checks and stacks",
                    meta.rank,
                    meta.pid,
                )
        tracker = RankTracker(
            path=path, reader=reader, meta=meta, owners=self.owners, proven=proven
        )
        tracker.last_activity = reader.header.created_mono_ns * _NS
        self.trackers[path] = tracker
        log.info("watching rank %d (pid %d) via %s", meta.rank, meta.pid, path.name)
        if gone:
            self._declare_gone(tracker, info)

    def _shares_namespace(self, meta: JournalMeta) -> bool | None:
        """Whether the writer's PIDs are ours to see; None when we cannot tell yet."""
        if meta.pid_ns:
            return meta.pid_ns == self._pid_ns
        return True if self._ns_shared else None

    def _declare_gone(self, t: RankTracker, info: ProcInfo) -> None:
        """A rank whose process ended before we first saw it. When it died is unknown: its last
        sign of life in the journal stands for it, so that of several ranks found dead at once
        the one that went silent first is named first."""
        t.poll()
        state = t.reader.state()
        last = max(t.last_activity, state.step_mono_ns * _NS, state.phase_mono_ns * _NS)
        now = time.monotonic()
        info.exited_at = min(now, last)
        log.warning(
            "rank %d (pid %d) ended before the agent first saw it (last sign of life %.2f s ago)",
            t.rank,
            t.meta.pid,
            now - info.exited_at,
        )

    def _judge_unsure(self) -> None:
        """Ranks whose PID we could not see before we knew the namespace is shared: gone."""
        for path in sorted(self._unsure):
            self._unsure.discard(path)
            t = self.trackers.get(path)
            info = self.procs.info(t.meta.pid) if t is not None else None
            if t is None or info is None or info.visible or info.exited_at is not None:
                continue
            if t.reader.header.created_mono_ns * _NS < self._started:
                self._stale.add((path, t.reader.inode))  # a leftover of an earlier run
                self._drop(path)
            else:
                self._declare_gone(t, info)

    def _drop(self, path: Path) -> None:
        t = self.trackers.pop(path)
        self.procs.forget(t.meta.pid)
        self.prover.forget(t.meta.pid)
        t.reader.close()

    def current(self) -> list[RankTracker]:
        """Trackers of the newest attempt (a restart leaves older journals behind)."""
        if not self.trackers:
            return []
        newest = max(t.meta.attempt for t in self.trackers.values())
        return [t for t in self.trackers.values() if t.meta.attempt == newest]

    def wait(self, timeout: float) -> list[int]:
        return self.procs.wait(timeout)

    def forget_ended(self, now: float) -> None:
        """Drops ranks whose process ended more than `ENDED_LINGER_S` ago. Their journal stays
        on disk for evidence, but a rank that is gone for good must not hold an incident open
        or be judged again (a relaunch under another job name, a rank of a finished run)."""
        for path, t in list(self.trackers.items()):
            info = self.procs.info(t.meta.pid)  # deaths are stamped by wait() and _snapshot
            if (
                info is not None
                and info.exited_at is not None
                and now - info.exited_at > (ENDED_LINGER_S)
            ):
                self._stale.add((path, t.reader.inode))
                self._drop(path)
                log.info("rank %d (pid %d) ended; no longer watched", t.rank, t.meta.pid)

    def observe(self, now: float) -> Observation:
        self.discover()
        self.forget_ended(now)
        ranks = []
        groups: dict[str, tuple[int, ...]] = {}
        recent: dict[int, tuple[OpView, ...]] = {}
        pg_timeout = 0.0
        timeouts: dict[str, float] = {}
        trackers = sorted(self.current(), key=lambda t: t.rank)
        for t in trackers:
            t.poll()
            ranks.append(self._snapshot(t, now))
            for g in t.meta.groups:
                groups.setdefault(g.name, g.ranks)
                if g.timeout_s > 0:
                    timeouts[g.name] = g.timeout_s
            recent[t.rank] = tuple(t.done_ops)
            pg_timeout = max(pg_timeout, t.meta.pg_timeout_s)
        world = max((t.meta.world_size for t in trackers), default=0)
        attempt = trackers[0].meta.attempt if trackers else 0
        # Every member of a world names its groups with the world's generation: the newest
        # one any local rank joined is the world the node trains in.
        generation = max((world_of(g) for g in groups), default=0)
        return Observation(
            now=now,
            ranks=tuple(ranks),
            groups=groups,
            world_size=world,
            attempt=attempt,
            world=generation,
            pg_timeout=pg_timeout,
            group_timeouts=timeouts,
            recent_ops=recent,
            job=trackers[0].meta.job if trackers else (self.job or ""),
        )

    def _snapshot(self, t: RankTracker, now: float) -> RankSnapshot:
        state = t.reader.state()
        info = self.procs.refresh(t.meta.pid, now)
        exited_at = info.exited_at if info is not None else None
        if state.status == JournalStatus.CLOSED:
            liveness = Liveness.CLOSED  # finished (maybe still tearing down): not judged any more
        elif exited_at is None:
            liveness = Liveness.RUNNING
        elif state.status == JournalStatus.FAILED:
            liveness = Liveness.FAILED
        else:
            liveness = Liveness.DIED
        last = t.last_activity
        if state.step_mono_ns:
            last = max(last, state.step_mono_ns * _NS)
        if state.phase_mono_ns:
            last = max(last, state.phase_mono_ns * _NS)
        pending = tuple(t.view(r) for _, r in sorted(t.pending.items()))
        if state.step == 0:
            t.cadence = fold(t.cadence, t.new_done, now, self.warmup_cadence)
        t.new_done.clear()
        return RankSnapshot(
            rank=t.rank,
            local_rank=t.meta.local_rank,
            pid=t.meta.pid,
            node=t.meta.node,
            liveness=liveness,
            started_at=t.reader.header.created_mono_ns * _NS,
            last_activity=last,
            step=state.step,
            phase=state.phase,
            phase_since=state.phase_mono_ns * _NS if state.phase else None,
            exited_at=exited_at,
            left_group=liveness == Liveness.CLOSED and state.closed_by == CloseReason.LEFT_GROUP,
            pending=pending,
            last_ops=dict(t.last_ops),
            p2p={k: tuple(h) for k, h in t.p2p.items()},
            step_durations=t.step_durations(),
            max_op_seconds=max(t.op_seconds, default=0.0),
            proc_state=info.state if info is not None else "",
            cpu_busy=info.cpu_busy if info is not None else 0.0,
            idle_since=info.idle_since if info is not None else None,
            cadence=t.cadence if state.step == 0 else None,
            launch_steps=t.launch_steps(state.step),
            launch_step_ends=tuple(t.launch_ends),
            pace=t.pace(),
        )

    def close(self) -> None:
        for path in list(self.trackers):
            self._drop(path)
        self.procs.close()


def _ident(path: Path, *, changes: bool) -> tuple[int, ...] | None:
    """What a file is, to tell whether it was replaced or given to another owner (`changes`: or
    rewritten at all; a journal is rewritten all the time, a meta only replaced)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if changes:
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    return (st.st_dev, st.st_ino, st.st_uid, stat.S_IFMT(st.st_mode))


def _file_id(path: Path) -> tuple[int, int] | None:
    ident = _ident(path, changes=False)
    return (ident[0], ident[1]) if ident is not None else None


def _claim(meta: JournalMeta, journal: tuple[int, int]) -> RankClaim:
    return claim_of(meta.pid, meta.pid_start_time, (journal,), meta.pid_ns)
