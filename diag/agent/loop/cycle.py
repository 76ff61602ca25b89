"""One watch cycle, from the journals to the actions: the hang path of the agent.

    journals --Observer.observe (observe/observer.py)--> Observation
             --decide (detect/hang.py, pure)--> Decision: verdict, events, actions
             --Executor.execute (here)--> evidence on disk, checkpoints, ranks stopped
             --sinks (sinks.py)--> job verdict, metrics, self-dumps, taint, retention

`Cycle.step` runs it once: before any evidence is written, a verdict is named after the job
incident it belongs to (job/link.py); with no verdict of its own, the node follows another
node's incident that broke the job (job/jobstop.py). The `Executor` carries out the core's
actions (capture evidence, persist checkpoints, stop ranks) and delivers the incident to the
sinks at its three moments: before the evidence, once the Python stacks are on disk, and once
the evidence is complete (before the ranks are stopped).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from diag.agent.detect.hang import (
    Action,
    ActionKind,
    Decision,
    EventKind,
    OnHang,
    Policy,
    Verdict,
    WatchState,
    decide,
    open_incident,
)
from diag.agent.detect.observation import Observation
from diag.agent.evidence.collection import (
    EvidenceResult,
    EvidenceTarget,
    IncidentReport,
    capture,
    verdict_document,
)
from diag.agent.evidence.pyspy import DumpTarget, Launcher
from diag.agent.job.jobstop import Local, StopState, closed, follow, verdict_for, wants_look
from diag.agent.job.link import JobLink, ranks_since_wall
from diag.agent.job.nodeview import view_document
from diag.agent.loop.inplace import Commands, answer_grace, ask_to_recover
from diag.agent.loop.sinks import Sink, Stage, deliver
from diag.agent.metrics.exporter import AgentMetrics
from diag.agent.observe.observer import Observer
from diag.agent.observe.rankproof import RankProof
from diag.formats.incidentdir import incident_id_of
from diag.formats.journalmeta import safe_job_name

log = logging.getLogger(__name__)

_WARNINGS = frozenset({EventKind.INCIDENT, EventKind.NO_STEPS})


class Cycle:
    """The watch cycle's state and its step: observe, decide, name, act."""

    def __init__(
        self,
        observer: Observer,
        executor: Executor,
        job_link: JobLink,
        policy: Policy,
        node: str,
        job: str | None,
        views: dict[str, dict[str, Any]],
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.observer = observer
        self.executor = executor
        self.job_link = job_link
        self.policy = policy
        self.node = node
        self.job = job
        self.views = views  # incident id -> our ranks at its verdict, for the job report
        self.metrics = metrics
        self.state = WatchState()
        self.job_stop = StopState()
        self.incidents = 0
        self.observations = 0

    def step(self, now: float) -> list[EventKind]:
        obs = self.observer.observe(now)
        self.observations += 1
        decision = decide(self.state, obs, self.policy)
        if decision.verdict is not None:
            wall = time.time()
            # Before any evidence is written: the job incident this one belongs to names it.
            verdict = self.job_link.resolve(decision.verdict, obs, obs.job or self.job or "", wall)
            decision = _under(decision, verdict)
            # Our ranks as they are now travel with our report for the job verdict, if we file
            # one: whoever assembles it can weigh them against the other nodes'.
            self.views[verdict.incident_id] = view_document(obs, self.node, wall)
        else:
            decision = self._follow_job(obs, decision, now)
        self.state = decision.state
        if self.metrics is not None:
            self.metrics.update(obs, self.state, decision.verdict)
        for e in decision.events:
            level = logging.WARNING if e.kind in _WARNINGS else logging.INFO
            log.log(level, "%s: %s", e.kind.value, e.message)
        for action in decision.actions:
            self.executor.execute(action)
        if decision.verdict is not None:
            self.incidents += 1
        return [e.kind for e in decision.events]

    def _follow_job(self, obs: Observation, decision: Decision, now: float) -> Decision:
        """With no incident of its own, the ranks stop with the rest of the job when another
        node's incident breaks it (jobstop.py): the same actions as a verdict of this node's."""
        job = obs.job or self.job or ""
        wall = time.time()
        incident = decision.state.incident
        local = Local(
            node=self.node,
            attempt=obs.attempt,
            world=obs.world,
            live_ranks=sum(r.alive for r in obs.ranks),
            since_wall=ranks_since_wall(obs, wall),
            open_incident=incident.incident_id if incident is not None else None,
            stop=self.policy.on_hang == OnHang.STOP and bool(job),
        )
        self.job_stop = closed(self.job_stop, local)
        if not wants_look(self.job_stop, local, now):
            return decision  # nothing listed: most checks of most nodes end here
        f = follow(
            self.job_stop, local, self.job_link.incidents(job, obs.attempt, local.since_wall), now
        )
        self.job_stop = f.state
        verdict = verdict_for(f, obs)
        if verdict is None or f.trigger is None:
            return decision
        if self.metrics is not None:
            self.metrics.job_stop(f.trigger.value)
        return open_incident(decision.state, obs, self.policy, verdict, decision.events)


def _under(decision: Decision, verdict: Verdict | None) -> Decision:
    """The decision with its verdict replaced in its state and actions too."""
    if verdict is None or verdict is decision.verdict:
        return decision
    return replace(
        decision,
        state=replace(decision.state, incident=verdict),
        verdict=verdict,
        actions=tuple(replace(a, verdict=verdict) for a in decision.actions),
    )


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
        sinks: Sequence[Sink] = (),
        commands: Commands | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.observer = observer
        self.commands = commands  # the control channel's sessions (RECOVER); None: stop instead
        self.metrics = metrics
        self.launcher = launcher  # who starts py-spy (None: this process)
        self.sinks = tuple(sinks)  # what happens after a verdict, in order (sinks.py)
        self.timeline = timeline
        self.node = node
        self.stop_grace = stop_grace
        self.native_stacks = native_stacks
        self.pyspy_timeout = pyspy_timeout
        self.dump_parallel = dump_parallel
        self.reports: list[IncidentReport] = []
        self._stoppers: list[threading.Thread] = []

    def execute(self, action: Action) -> None:
        if action.kind == ActionKind.CAPTURE_EVIDENCE:
            self._capture(action.verdict)
        elif action.kind == ActionKind.PERSIST_CHECKPOINT:
            report = IncidentReport(action.verdict, None, self._job(), self.node)
            deliver(self.sinks, Stage.BEFORE_EVIDENCE, report)
        elif action.kind == ActionKind.STOP_RANKS:
            self._stop(action.ranks)
        elif action.kind == ActionKind.RECOVER_RANKS:
            self._recover(action.verdict, action.ranks, action.delay_s)

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
        job = self._job()
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
                on_disk=lambda early: deliver(
                    self.sinks, Stage.ON_DISK, IncidentReport(verdict, early, job, self.node)
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
        deliver(self.sinks, Stage.CAPTURED, report)

    def _job(self) -> str:
        current = self.observer.current()
        return (current and current[0].meta.job) or (self.observer.job or "")

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

    def _recover(self, verdict: Verdict, ranks: tuple[int, ...], delay: float = 0.0) -> None:
        """RECOVER to the ranks, `delay` seconds later, off the watch loop (it waits for their
        answers); those that cannot recover in place are stopped."""
        job = self._job()
        commands = self.commands
        if commands is None or not job:
            self._stop(ranks)
            return
        # The verdict's moment on the wall clock, which the ranks on this node share: a rank
        # whose world formed again after it has recovered from this fault already.
        at = time.time() - max(0.0, time.monotonic() - verdict.at)

        def run() -> None:
            if delay > 0:  # ranks the fault reached meanwhile answer "recovering already"
                time.sleep(delay)
            outcome = ask_to_recover(
                commands, safe_job_name(job), ranks, verdict.summary, at,
                answer_grace(self.stop_grace),
            )  # fmt: skip
            if self.metrics is not None:
                stopped = len(set(outcome.to_stop) - set(outcome.not_asked))
                self.metrics.recover_in_place(job, len(outcome.taken), stopped,
                                              len(outcome.not_asked))  # fmt: skip
            if outcome.to_stop:
                self._stop(outcome.to_stop)

        thread = threading.Thread(target=run, name="diag-recover", daemon=True)
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
