"""The agent's replication, wired into the loop: starting it (an empty node's restore first), its
facts for the metrics, and the handover of a lost peer's replica to storage.

The handover (agent.replica.handover decides): once this node's ranks died or were stopped and
their own newest snapshots are persisted (CheckpointManager.stopped_hooks), a thread asks the
agents of the peers this node holds replicas for whether they answer, every `--replica-interval`
seconds; a peer silent for `--replica-lost-after` seconds whose replica is newer than the step
storage names gets its replica's parts written to storage by the same persist as a rank's own
slot (the parts are slot files, with the same completeness marker), each marked done, and the
step committed once every rank's part is there. A job that then restarts smaller, without the
lost node, resumes from that step (through DeepSpeed's universal checkpoint at another size).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from diag.agent.checkpoint import storage
from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.persist import PersistResult, persist_slot
from diag.agent.checkpoint.ranknotes import RankNotes, ReplicaState
from diag.agent.checkpoint.savedir import SaveDirRule, rule_for
from diag.agent.config.agentconfig import AgentSettings
from diag.agent.loop.peerwatch import PROBE_TIMEOUT_S, agent_answers
from diag.agent.metrics.replicastats import ReplicaFacts
from diag.agent.replica.handover import (
    Handover,
    HeldReplica,
    PeerFacts,
    Reach,
    StorageView,
    Verdict,
    decide_handover,
    look_again,
    next_reach,
    wants_reach,
)
from diag.agent.replica.replicator import Replicator
from diag.agent.replica.ring import RingError
from diag.agent.replica.store import Replica
from diag.formats.exitcodes import UsageError
from diag.formats.journalmeta import safe_job_name
from diag.formats.snapshot import read_latest_step
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

GIVE_UP_S = 300.0  # past `lost_after`: how long a peer that answers is watched for its parts


def start_replication(
    cfg: AgentSettings, owners: Owners, checkpoints: CheckpointManager
) -> Replicator | None:
    """An empty node takes its ranks' newest replica from a peer (before the control channel
    opens); then replication runs in the background. None without --replica-nodes."""
    if cfg.replica is None or cfg.job is None:
        return None
    save_dir = cfg.checkpoint.save_dir
    try:
        replicator = Replicator(
            cfg.replica, run_dir=cfg.run_dir, job=cfg.job, node=cfg.node, owners=owners,
            storage_step=lambda: read_latest_step(save_dir) if save_dir else None,
        )  # fmt: skip
    except RingError as e:
        raise UsageError(f"--replica-nodes: {e}") from None
    except (OSError, ssl.SSLError, ValueError) as e:
        raise UsageError(
            f"cannot set up replication: {e}; check --replica-token and the --replica-tls-* files"
        ) from None
    replicator.restore_at_start()
    got = replicator.installed
    if got is not None:  # what the holder sent names no save directory this node writes to
        checkpoints.pulled.add(got.paths, got.step, got.run)
    try:
        replicator.start()
    except OSError as e:
        raise UsageError(
            f"cannot serve replicas on {cfg.replica.listen_host}: {e.strerror}; check the "
            "port this node has in --replica-nodes"
        ) from None
    return replicator


def connect_ranks(replicator: Replicator, notes: RankNotes) -> None:
    """The ranks learn replication's state (on, the round step every holder holds) and each
    completed snapshot of theirs wakes the pushes."""

    def state() -> ReplicaState:
        got = replicator.confirmed()
        return ReplicaState(*got) if got is not None else ReplicaState()

    notes.replica = state
    notes.on_saved.append(lambda job, rank, step: replicator.notify())
    replicator.on_confirmed.append(lambda: notes.confirmed(replicator.job))


def replica_facts(
    replicator: Replicator | None, handover: Handoff | None, notes: RankNotes | None = None
) -> ReplicaFacts:
    fallbacks = notes.fallbacks if notes is not None else 0
    mismatches = notes.mismatches if notes is not None else 0
    if replicator is None:
        return ReplicaFacts(restore_fallbacks=fallbacks, node_mismatches=mismatches)
    st = replicator.stats()
    restore = st.restore
    done = handover.stats() if handover is not None else HandoffStats()
    return ReplicaFacts(
        restore_fallbacks=fallbacks,
        node_mismatches=mismatches,
        sent_step=st.sent_step,
        pushes=st.pushes,
        push_failures=st.push_failures,
        push_seconds=st.last_push_seconds if st.pushes else None,
        push_bytes=st.last_push_bytes if st.pushes else None,
        held=st.held,
        restore_source=restore.source.value if restore else None,
        restore_step=restore.step if restore else None,
        restore_seconds=st.restore_seconds if restore else None,
        handed_over=dict(done.steps),
        handover_failures=done.failures,
    )


@dataclass
class HandoffStats:
    steps: dict[str, int] = field(default_factory=dict)  # lost peer -> step written to storage
    failures: int = 0  # parts not written


class Handoff:
    """Writes the replicas of lost peers to storage after this node's ranks were stopped."""

    def __init__(
        self,
        replicator: Replicator,
        checkpoints: CheckpointManager,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicator = replicator
        self.checkpoints = checkpoints
        self.job = safe_job_name(replicator.job)
        self.clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._again = False  # a stop of this node's ranks not looked at yet
        self._running = False
        self._marked = False  # holds the checkpoints' writing mark of the job
        self._stop = threading.Event()
        self._written: set[tuple[str, int, str]] = set()
        self._stats = HandoffStats()

    def ranks_stopped(self, jobs: set[str]) -> None:
        """This node's ranks of `jobs` died or are being stopped (their own snapshots persisted):
        look at the peers in the background, the caller never waits."""
        if self.job not in jobs:
            return
        with self._lock:
            self._again = True
            # before the persist of the ranks' own snapshots lets the mark go: ranks restarting
            # at another size wait until it is known whether a lost peer's replica is written
            self._mark()
            if self._running:
                return  # the running look takes it: it looks again before it ends
            self._running = True
            self._thread = threading.Thread(target=self._run, name="replica-handover", daemon=True)
            self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        with self._lock:
            t = self._thread
        if t is not None:
            t.join(timeout)

    def stats(self) -> HandoffStats:
        with self._lock:
            return HandoffStats(dict(self._stats.steps), self._stats.failures)

    def close(self) -> None:
        self._stop.set()
        self.join(PROBE_TIMEOUT_S + 5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not self._again:
                        self._running = False
                        return
                    self._again = False
                try:
                    self._look()
                except Exception:  # a thread of its own: its failure is logged, never the agent's
                    log.exception("the handover of lost peers' replicas failed")
            with self._lock:
                self._running = False
        finally:
            self._unmark(force=True)

    def _mark(self) -> None:
        """Takes the writing mark (with self._lock held)."""
        if not self._marked:
            self.checkpoints.writing.take(self.job)
            self._marked = True

    def _unmark(self, *, force: bool = False) -> None:
        """Lets the writing mark go, unless a stop of the ranks came that no look has seen."""
        with self._lock:
            if self._marked and (force or not self._again):
                self._marked = False
                self.checkpoints.writing.release(self.job)

    def _look(self) -> None:
        settings = self.replicator.settings
        reach: dict[str, Reach] = {}
        said: dict[str, Verdict] = {}
        failed: set[tuple[str, int]] = set()  # tried in this look: the next stop tries again
        give_up = self.clock() + settings.lost_after + GIVE_UP_S
        while not self._stop.is_set():
            now = self.clock()
            with self._lock:
                written = frozenset(self._written)
                self._again = False  # this round sees the newest facts
            facts = self._facts(reach, now, written)
            verdicts = decide_handover(
                facts, stopped=True, lost_after=settings.lost_after, now=now, written=written
            )
            for v in verdicts:
                if said.get(v.peer) != v.verdict and v.verdict != Verdict.PERSIST:
                    log.info("replica of %s (step %d): %s (%s)", v.peer, v.step,
                             v.verdict.value, v.reason)  # fmt: skip
                said[v.peer] = v.verdict
            for v, f in zip(verdicts, facts, strict=True):
                tried = (v.peer, v.step) in failed
                if v.verdict == Verdict.PERSIST and not tried and not self._write(f.replica, v):
                    failed.add((v.peer, v.step))
            if not any(v.verdict == Verdict.WAIT for v in verdicts):
                self._unmark()  # every lost peer's replica written (or tried): restarts go on
            if not look_again(verdicts):
                return
            if self.clock() > give_up:
                log.info("stopped watching the replicas' peers: %s",
                         ", ".join(f"{v.peer} {v.verdict.value}" for v in verdicts))  # fmt: skip
                return
            self._stop.wait(settings.interval)

    def _facts(
        self, reach: dict[str, Reach], now: float, written: frozenset[tuple[str, int, str]]
    ) -> list[PeerFacts]:
        store = self.replicator.store
        if store is None:
            return []
        save_dir, _ = self._target()
        latest = read_latest_step(save_dir) if save_dir is not None else None
        out = []
        for peer in store.nodes():
            held = store.held(peer)
            if held is None or safe_job_name(held.manifest.job) != self.job:
                continue
            m = held.manifest
            done: frozenset[int] = frozenset()
            if save_dir is not None:
                runs = storage.marker_runs(save_dir, m.step)
                done = frozenset(r for r, run in runs.items() if run == m.run)
            replica = HeldReplica(peer, m.step, m.run, m.ranks)
            view = StorageView(latest, done)
            if peer in self.replicator.peers.addresses and wants_reach(replica, view, written):
                reach[peer] = next_reach(reach.get(peer), self._answers(peer), now)
            out.append(PeerFacts(replica, view, reach.get(peer)))
        return out

    def _answers(self, peer: str) -> bool:
        return agent_answers(self.replicator, peer)

    def _target(self) -> tuple[Path | None, SaveDirRule | None]:
        """Where a peer's replica goes, and whose directory that may be: --save-dir, else the
        save directory this node's own ranks name (a replica's description came from another
        node: the save directory it names is not trusted to be written into)."""
        own = self.checkpoints.options.save_dir
        if own is not None:
            return own, None
        snaps = self.checkpoints.own_snapshots(self.job)  # not a slot pulled from a peer
        if not snaps:
            return None, None
        newest = max(snaps, key=lambda s: s.meta.step)
        try:
            owner = newest.path.stat().st_uid
        except OSError:
            return None, None
        rule = rule_for(from_operator=False, slot_owner=owner, agent_euid=os.geteuid())
        return Path(newest.meta.save_dir), rule

    def _write(self, replica: HeldReplica, verdict: Handover) -> bool:
        """Writes the ranks the verdict names; False when a part could not be written."""
        ranks, reason = verdict.ranks, verdict.reason
        store = self.replicator.store
        held = store.held(replica.peer) if store is not None else None
        if store is None or held is None or held.manifest.step != replica.step:
            return True  # replaced meanwhile: the next round decides on the new one
        target, rule = self._target()
        if target is None:
            log.warning(
                "cannot write %s's replica of step %d to storage: this node's ranks name no save "
                "directory (no snapshot left) and --save-dir is not set",
                replica.peer, replica.step,
            )  # fmt: skip
            self._done(replica, ok=False, failures=len(ranks))
            return False
        log.warning("%s is lost (%s): writing its replica of step %d (ranks %s) to %s",
                    replica.peer, reason, replica.step, list(ranks), target)  # fmt: skip
        t0 = time.monotonic()
        results = [self._persist(held, rank, target, rule) for rank in ranks]
        failed = [r for r in results if not r.ok]
        committed = any(r.committed for r in results)
        for r in failed:
            log.warning("could not write %s's rank %d of step %d: %s",
                        replica.peer, r.rank, replica.step, r.error)  # fmt: skip
        latest = read_latest_step(target)
        log.log(
            logging.WARNING if failed else logging.INFO,
            "wrote %d of %d part(s) of lost %s's replica of step %d in %.2f s (%.1f MB)%s; "
            "storage names %s",
            len(results) - len(failed), len(results), replica.peer, replica.step,
            time.monotonic() - t0, sum(r.nbytes for r in results) / 1e6,
            " and committed it" if committed else "",
            "no step" if latest is None else f"step {latest}",
        )  # fmt: skip
        self._done(replica, ok=not failed, failures=len(failed))
        return not failed

    def _persist(
        self, held: Replica, rank: int, target: Path, rule: SaveDirRule | None
    ) -> PersistResult:
        part = next(p for p in held.manifest.parts if p.rank == rank)
        o = self.checkpoints.options
        store = self.replicator.store
        return persist_slot(
            held.part_path(part), step=held.manifest.step, save_dir=target, keep=o.keep_last,
            lock_timeout=o.lock_timeout, owners=store.owners if store is not None else None,
            rule=rule,
        )  # fmt: skip

    def _done(self, replica: HeldReplica, *, ok: bool, failures: int) -> None:
        with self._lock:
            self._stats.failures += failures
            if ok:
                self._written.add((replica.peer, replica.step, replica.run))
                self._stats.steps[replica.peer] = replica.step
