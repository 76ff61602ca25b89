"""Carries out the core's actions: capture evidence, persist checkpoints, stop ranks.

Other parts of the agent (checkpoint persistence, node taints, metrics) subscribe through
`IncidentListener`s, called in order after the evidence is on disk and before ranks are stopped.
`on_disk` listeners are called earlier, as soon as the incident directory holds the Python
stacks (before the slower native ones): the job verdict should not wait for those.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

from diag.agent.detect.hang import Action, ActionKind, Verdict
from diag.agent.evidence.collection import (
    EvidenceResult,
    EvidenceTarget,
    IncidentReport,
    capture,
    verdict_document,
)
from diag.agent.evidence.pyspy import DumpTarget, Launcher
from diag.agent.observe.observer import Observer
from diag.agent.observe.rankproof import RankProof
from diag.formats.incidentdir import incident_id_of

log = logging.getLogger(__name__)


IncidentListener = Callable[[IncidentReport], None]
PersistHook = Callable[[Verdict], None]


class Executor:
    def __init__(
        self,
        observer: Observer,
        timeline: Path,
        node: str,
        *,
        stop_grace: float = 10.0,
        native_stacks: bool = True,
        pyspy_timeout: float = 10.0,
        dump_parallel: int = 0,
        launcher: Launcher | None = None,
    ) -> None:
        self.observer = observer
        self.launcher = launcher  # who starts py-spy (None: this process)
        self.timeline = timeline
        self.node = node
        self.stop_grace = stop_grace
        self.native_stacks = native_stacks
        self.pyspy_timeout = pyspy_timeout
        self.dump_parallel = dump_parallel
        self.listeners: list[IncidentListener] = []
        self.on_disk: list[IncidentListener] = []
        self.persist_hooks: list[PersistHook] = []
        self.reports: list[IncidentReport] = []
        self._stoppers: list[threading.Thread] = []

    def execute(self, action: Action) -> None:
        if action.kind == ActionKind.CAPTURE_EVIDENCE:
            self._capture(action.verdict)
        elif action.kind == ActionKind.PERSIST_CHECKPOINT:
            for hook in self.persist_hooks:
                try:
                    hook(action.verdict)
                except Exception:
                    log.exception("checkpoint persistence failed")
        elif action.kind == ActionKind.STOP_RANKS:
            self._stop(action.ranks)

    def _targets(self) -> list[EvidenceTarget]:
        """Every rank's journal; a stack only of a process shown, now, to be its rank."""
        out = []
        for t in sorted(self.observer.current(), key=lambda t: t.rank):
            proof = self.observer.proof(t)
            out.append(
                EvidenceTarget(
                    DumpTarget(
                        rank=t.meta.rank,
                        world_size=t.meta.world_size,
                        pid=t.meta.pid if proof else 0,
                        local_rank=t.meta.local_rank,
                        node=t.meta.node,
                        claim=self.observer.claim(t) if proof else None,
                    ),
                    journal=t.path,
                    unproven=_why_not(proof),
                    owners=self.observer.owners,
                )
            )
        return out

    def _capture(self, verdict: Verdict) -> None:
        # Suspects first: where native dumps queue for a core, theirs reach the disk first.
        order = {s.rank: i for i, s in enumerate(verdict.suspects)}
        targets = sorted(
            self._targets(), key=lambda t: (order.get(t.dump.rank, len(order)), t.dump.rank)
        )
        job = (targets and self.observer.current()[0].meta.job) or (self.observer.job or "")
        world = max((t.dump.world_size for t in targets), default=0)
        doc = verdict_document(
            verdict,
            kind=verdict.kind.value,
            incident_id=incident_id_of(job, verdict.incident_id),
            job=job,
            node=self.node,
            world_size=world,
            detected_at=dt.datetime.now(dt.UTC),
            summary=verdict.summary,
        )
        result: EvidenceResult | None = None
        try:
            result = capture(
                targets,
                self.timeline,
                doc,
                native=self.native_stacks,
                pyspy_timeout=self.pyspy_timeout,
                dump_parallel=self.dump_parallel,
                launcher=self.launcher,
                on_disk=lambda early: self._notify(
                    self.on_disk, IncidentReport(verdict, early, job, self.node)
                ),
            )
            log.warning(
                "evidence of %d ranks in %s (on disk after %.2f s, native stacks after %.2f s)",
                len(targets),
                result.path,
                result.on_disk_seconds,
                result.total_seconds,
            )
        except OSError as e:
            log.error(
                "could not write the incident under %s: %s. Its evidence (stacks, journals) is "
                "lost, the verdict is only in this log; checkpoints are persisted regardless. "
                "Make the timeline writable and give it room (--timeline or DIAG_TIMELINE)",
                self.timeline, e.strerror or e,
            )  # fmt: skip
        report = IncidentReport(verdict, result, job, self.node)
        self.reports.append(report)
        self._notify(self.listeners, report)

    @staticmethod
    def _notify(listeners: list[IncidentListener], report: IncidentReport) -> None:
        for listener in listeners:
            try:
                listener(report)
            except Exception:
                log.exception("incident listener %r failed", listener)

    def _stop(self, ranks: tuple[int, ...]) -> None:
        procs = []
        for t in self.observer.current():
            if t.rank not in ranks:
                continue
            proof = self.observer.proof(t)
            if not proof:
                if proof.exists:
                    log.warning("not stopping rank %d: %s", t.rank, proof.reason)
                continue
            try:
                p = psutil.Process(t.meta.pid)
                if abs(p.create_time() - t.meta.pid_start_time) <= 0.05:
                    procs.append((t.rank, p))
            except psutil.NoSuchProcess:
                continue
        if not procs:
            return
        thread = threading.Thread(
            target=stop_processes, args=(procs, self.stop_grace), name="diag-stop", daemon=True
        )
        thread.start()
        self._stoppers.append(thread)

    def join(self, timeout: float | None = None) -> None:
        for t in self._stoppers:
            t.join(timeout)


def _why_not(proof: RankProof) -> str:
    if proof:
        return ""
    return proof.reason if proof.exists else f"the process is gone ({proof.reason})"


def stop_processes(procs: list[tuple[int, psutil.Process]], grace: float) -> None:
    """SIGTERM, then SIGKILL whatever is still there after `grace` seconds."""
    for rank, p in procs:
        log.warning("stopping rank %d (pid %d): SIGTERM", rank, p.pid)
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs([p for _, p in procs], timeout=grace)
    for p in alive:
        log.warning("pid %d ignored SIGTERM for %.0f s: SIGKILL", p.pid, grace)
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()  # psutil checks the PID still names the same process
