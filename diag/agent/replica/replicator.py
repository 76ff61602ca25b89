"""A node's replication, end to end: at start, restore an empty node from its holders; then hold
the replicas of the nodes before it in the ring and send its own newest replication round's step
(trainer.flash.replicarounds) to the nodes after it, in the background, as soon as its ranks complete it.

The sending thread is woken by each rank's note that it completed a round's snapshot (the control
channel's Saved) and also looks at the slot headers every `interval` seconds (a few bytes of
shared memory per slot), parsing descriptions only when a header changed; the ranks are never
waited for: a push reads the slot under a shared lock, while the ranks write their next snapshot
into another slot. Once every holder took a round step, the ranks are told (`on_confirmed`):
their next save may start the next round.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from diag.agent.replica.deadline import DeadlineExceeded
from diag.agent.replica.pace import pace_for
from diag.agent.replica.ring import Offer, RestoreChoice, Ring, Source, choose_restore
from diag.agent.replica.settings import NodeAddress as NodeAddress
from diag.agent.replica.settings import ReplicaSettings
from diag.agent.replica.source import local_steps, look
from diag.agent.replica.store import ReplicaStore
from diag.agent.replica.tls import Tls
from diag.agent.replica.transport import (
    OFFER_DEADLINE_S,
    Address,
    Peers,
    ReplicaServer,
    ask_offer,
    pull,
    push,
)
from diag.agent.replica.wire import CHUNK
from diag.formats.slotfile import open_slot
from diag.formats.snapshot import find_slots, pull_marker_path
from diag.formats.untrusted import Owners, UntrustedInput

log = logging.getLogger(__name__)

REPLICA_DIR = ".replicas"
VERIFY_S = 10.0  # seconds between asking the holders what they hold
RETRY_MAX_S = 10.0  # the longest wait before pushing again to a holder that failed


def retry_delay(failures: int, interval: float) -> float:
    """Seconds before the next push to a holder after `failures` failures in a row: doubling
    from the interval, at most RETRY_MAX_S, so a holder that is down costs a try every few
    seconds, not one (and a warning) every look."""
    return min(RETRY_MAX_S, interval * 2 ** min(failures, 32))


@dataclass
class ReplicaStats:
    sent_step: int | None = None  # the newest step every holder took
    pushes: int = 0
    push_failures: int = 0
    last_push_seconds: float = 0.0
    last_push_bytes: int = 0
    held: dict[str, int] = field(default_factory=dict)  # peer -> step held for it
    restore: RestoreChoice | None = None
    restore_seconds: float = 0.0


@dataclass(frozen=True)
class Installed:
    """The slots an empty node's restore installed from a holder's replica."""

    holder: str
    step: int
    run: str
    paths: tuple[Path, ...]


class Replicator:
    def __init__(
        self,
        settings: ReplicaSettings,
        *,
        run_dir: Path,
        job: str,
        node: str,
        owners: Owners,
        storage_step: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.job = job
        self.node = node
        self.owners = owners
        self.storage_step = storage_step
        ring = Ring.of([n.name for n in settings.nodes], settings.factor)
        addresses: dict[str, Address] = {n.name: (n.host, n.port) for n in settings.nodes}
        tls = Tls.load(settings.tls) if settings.tls is not None else None
        self.peers = Peers(ring, addresses, node, job, settings.token, tls)
        self.holders = ring.holders(node)  # raises RingError for a node not in the ring
        self._stats = ReplicaStats()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sent: dict[str, tuple[int, str]] = {}
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._failed_last = False
        self._failures: dict[str, int] = {}  # holder -> pushes failed in a row
        self._retry_at: dict[str, float] = {}  # holder -> no push to it before (monotonic)
        self._verified_at = float("-inf")
        self._confirmed: tuple[int, str] | None = None  # the round step every holder holds
        self.on_confirmed: list[Callable[[], None]] = []
        self._foreign_warned: set[str] = set()
        self._pace = pace_for(settings.max_rate, CHUNK)  # one budget for every holder's pushes
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None
        self._thread: threading.Thread | None = None
        self.installed: Installed | None = None  # what the restore pulled, if anything

    # -- at start ---------------------------------------------------------------------------------

    def restore_at_start(self) -> RestoreChoice:
        """Before the ranks start: an empty node takes its newest replica from a holder."""
        t0 = time.monotonic()
        marker = pull_marker_path(self.run_dir, self.job)
        try:
            choice = self._restore(marker)
        finally:
            marker.unlink(missing_ok=True)  # also one a killed agent left
        seconds = time.monotonic() - t0
        log.info(
            "replica restore: %s%s (%s; %.2f s)",
            choice.source.value,
            f" step {choice.step}" if choice.step is not None else "",
            choice.reason,
            seconds,
        )
        with self._lock:
            self._stats.restore, self._stats.restore_seconds = choice, seconds
        return choice

    def _restore(self, marker: Path) -> RestoreChoice:
        until = time.monotonic() + self.settings.pull_deadline
        held = local_steps(self.run_dir, self.job, self.node, self.owners)
        if not held and self.holders:
            # ranks starting meanwhile wait for this to go before they look for snapshots
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            marker.unlink(missing_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(marker, flags, 0o600))
        offers = [] if held else self._offers(until)
        choice = choose_restore(
            local_steps=held,
            offers=offers,
            storage_step=None if held else self.storage_step(),
            ranks=(),
            holders=self.holders,
        )
        # The best offer first, then the others: a holder that fails mid-pull is not the end.
        if choice.source == Source.PEER:
            ordered = sorted(offers, key=lambda o: o.step, reverse=True)
            choice = self._pull_first(ordered, choice, until) or replace(
                choice, source=Source.STORAGE, holder=None,
                reason=f"{choice.reason}, but no holder gave it: storage",
            )  # fmt: skip
        return choice

    def _offers(self, until: float) -> list[Offer]:
        out = []
        for holder in self.holders:
            left = until - time.monotonic()
            if left <= 0:
                log.warning("replica restore: no time left to ask %s (--replica-pull-deadline "
                            "%g s)", holder, self.settings.pull_deadline)  # fmt: skip
                break
            try:
                o = ask_offer(self.peers, holder, timeout=min(5.0, self.settings.timeout, left),
                              deadline=min(OFFER_DEADLINE_S, left))  # fmt: skip
            except (OSError, UntrustedInput) as e:
                level = logging.WARNING if isinstance(e, UntrustedInput) else logging.INFO
                log.log(level, "replica holder %s has no offer: %s", holder, e)
                continue
            if o.step is not None:
                out.append(Offer(holder, o.step, o.run, o.world_size, o.ranks))
        return out

    def _pull_first(
        self, offers: list[Offer], choice: RestoreChoice, until: float
    ) -> RestoreChoice | None:
        for o in offers:
            if choice.step is not None and o.step < choice.step:
                break  # never an older replica than the choice: storage instead
            left = until - time.monotonic()
            if left <= 0:
                log.warning("replica restore: --replica-pull-deadline (%g s) passed before the "
                            "pull from %s: the ranks restore from storage",
                            self.settings.pull_deadline, o.holder)  # fmt: skip
                break
            try:
                m, paths = pull(
                    self.peers, o.holder, self.run_dir,
                    max_bytes=self.settings.max_bytes, timeout=self.settings.timeout,
                    deadline=left,
                )  # fmt: skip
            except DeadlineExceeded as e:
                log.warning("pulling the replica from %s failed: %s (--replica-pull-deadline): "
                            "the ranks restore from storage", o.holder, e)  # fmt: skip
                break
            except (OSError, UntrustedInput) as e:
                log.warning("pulling the replica from %s failed: %s", o.holder, e)
                continue
            self.installed = Installed(o.holder, m.step, m.run, tuple(paths))
            return RestoreChoice(Source.PEER, m.step, o.holder, f"{o.holder} held step {m.step}")
        return None

    # -- holding and sending ----------------------------------------------------------------------

    def start(self) -> Replicator:
        s = self.settings
        directory = s.directory or self.run_dir / REPLICA_DIR
        self.store = ReplicaStore(directory, s.max_bytes)
        port = self.peers.address(self.node)[1]
        self.server = ReplicaServer(self.store, self.peers, (s.listen_host, port)).start()
        self._thread = threading.Thread(target=self._run, name="replica-push", daemon=True)
        self._thread.start()
        return self

    def notify(self) -> None:
        """A rank completed a snapshot: look for a newer step now rather than at the next tick."""
        self._wake.set()

    def confirmed(self) -> tuple[int, str] | None:
        """The round step (and launch) every holder of this node holds, or None."""
        with self._lock:
            return self._confirmed

    def _confirm(self) -> None:
        """Records what every holder holds; the ranks are told when it changed."""
        held = {self._sent.get(h) for h in self.holders}
        now = held.pop() if len(held) == 1 else None
        with self._lock:
            changed, self._confirmed = now != self._confirmed and now is not None, now
        if changed:
            for hook in list(self.on_confirmed):
                try:
                    hook()
                except Exception:
                    log.exception("telling the ranks of a confirmed replica failed")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now - self._verified_at >= max(VERIFY_S, self.settings.interval):
                    self._verified_at = now
                    self.verify_holders()
                self.push_once()
            except Exception:  # the thread must outlive any one bad round
                log.exception("replication round failed")
            self._wake.wait(self.settings.interval)
            self._wake.clear()

    def verify_holders(self) -> None:
        """Asks each holder what it holds: a holder replaced since (its memory lost with it) or
        one that dropped the replica is sent it again."""
        for holder in self.holders:
            try:
                o = ask_offer(self.peers, holder, timeout=min(5.0, self.settings.timeout))
            except (OSError, UntrustedInput):
                continue  # down: the next push to it says more
            self._retry_at.pop(holder, None)  # it answers: no backoff for the next push
            if o.step is None:
                self._sent.pop(holder, None)
            else:
                self._sent[holder] = (o.step, o.run)
        self._confirm()

    def _headers_changed(self) -> bool:
        sig = []
        for p in find_slots(self.run_dir, self.job):
            slot = open_slot(p, self.owners)
            if slot is None:
                continue
            try:
                h = slot.header()
                sig.append((p.name, h.gen, h.step))
            except ValueError:
                continue
            finally:
                slot.close()
        signature = tuple(sig)
        changed = signature != self._signature
        self._signature = signature
        return changed

    def push_once(self) -> bool:
        """Sends the newest complete step to every holder that lacks it; True when all have it."""
        if not self.holders:
            return True
        changed = self._headers_changed()
        if not changed and not self._failed_last and all(h in self._sent for h in self.holders):
            return True
        found = look(self.run_dir, self.job, self.node, self.owners)
        self._warn_foreign(found.nodes)
        local = found.replica
        if local is None:
            return True
        want = (local.manifest.step, local.manifest.run)
        ok = True
        for holder in self.holders:
            if self._sent.get(holder) == want:
                continue
            t0 = time.monotonic()
            if t0 < self._retry_at.get(holder, 0.0):
                ok = False  # failed lately: its backoff is not over
                continue
            try:
                result = push(self.peers, holder, local, self.owners,
                              timeout=self.settings.timeout, pace=self._pace)  # fmt: skip
                error = "" if result.ok else result.error
            except (OSError, UntrustedInput) as e:
                error = str(e)
            seconds = time.monotonic() - t0
            with self._lock:
                if error:
                    self._stats.push_failures += 1
                else:
                    self._stats.pushes += 1
                    self._stats.last_push_seconds = seconds
                    self._stats.last_push_bytes = local.manifest.nbytes
            if error:
                ok = False
                n = self._failures[holder] = self._failures.get(holder, 0) + 1
                self._retry_at[holder] = time.monotonic() + retry_delay(n, self.settings.interval)
                log.log(
                    logging.WARNING if n == 1 else logging.DEBUG,
                    "replica of step %d to %s failed: %s%s", want[0], holder, error,
                    f" (trying again every {RETRY_MAX_S:g} s at most)" if n == 1 else "",
                )  # fmt: skip
                continue
            if self._failures.pop(holder, 0):
                log.warning("replica of step %d to %s sent: the holder takes it again",
                            want[0], holder)  # fmt: skip
            self._retry_at.pop(holder, None)
            self._sent[holder] = want
            log.debug("replica of step %d to %s in %.3f s", want[0], holder, seconds)
        with self._lock:
            if all(self._sent.get(h) == want for h in self.holders):
                self._stats.sent_step = want[0]
        self._confirm()
        self._failed_last = not ok
        return ok

    def _warn_foreign(self, nodes: frozenset[str]) -> None:
        """Snapshots of the job naming another node than this one are never sent: say so, once
        per name (the ranks' DIAG_NODE differs from the agent's --node)."""
        for other in sorted(nodes - {self.node} - self._foreign_warned):
            self._foreign_warned.add(other)
            log.error(
                "the ranks' snapshots in %s name node %r, but this agent is node %r: they are "
                "not replicated (only this node's are); give DIAG_NODE the same value in the "
                "trainer's and the agent's environment", self.run_dir, other[:256], self.node,
            )  # fmt: skip

    def stats(self) -> ReplicaStats:
        with self._lock:
            out = replace(self._stats)
        if self.store is not None:
            out.held = {
                n: r.manifest.step
                for n in self.store.nodes()
                if (r := self.store.held(n)) is not None
            }
        return out

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.settings.timeout + 5)
        if self.server is not None:
            self.server.close()
        if self.store is not None:
            self.store.close()
