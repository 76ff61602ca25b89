"""`diag agent`: the sidecar's main loop. Observe, decide (pure core), execute, repeat.

The loop sleeps in poll() on the ranks' pidfds between checks, so a rank's death wakes it at once;
everything else is seen within one `--interval`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
import time
from dataclasses import replace
from types import FrameType
from typing import Any

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.ranknotes import RankNotes
from diag.agent.checkpoint.service import ControlServer
from diag.agent.config import agentconfig as config_mod
from diag.agent.config.agentconfig import AgentConfig
from diag.agent.config.options import Until
from diag.agent.detect.hang import (
    Decision,
    EventKind,
    OnHang,
    Verdict,
    WatchState,
    decide,
    open_incident,
)
from diag.agent.detect.observation import Observation
from diag.agent.drain.executor import Drainer
from diag.agent.drain.notice import NoticeWatcher
from diag.agent.drain.plan import DrainRequest
from diag.agent.evidence.collection import IncidentReport
from diag.agent.evidence.pyspy import Launcher, can_trace
from diag.agent.health.monitors import monitors_for
from diag.agent.health.watch import HealthWatch
from diag.agent.job.jobstop import Local, StopState, closed, follow, verdict_for, wants_look
from diag.agent.job.link import JobLink, ranks_since_wall
from diag.agent.job.nodeview import view_document
from diag.agent.job.verdict import JobVerdictStore
from diag.agent.loop.actions import Executor
from diag.agent.loop.draining import Drains
from diag.agent.loop.incidenthooks import ask_own_dumps, persist_before_acting
from diag.agent.loop.replication import (
    Handoff,
    connect_ranks,
    replica_facts,
    start_replication,
)
from diag.agent.loop.startup import AgentStart, serve_metrics
from diag.agent.metrics.exporter import AgentMetrics
from diag.agent.metrics.server import MetricsServer
from diag.agent.observe.observer import Observer
from diag.agent.observe.rundircheck import owners_of
from diag.agent.replica.replicator import Replicator
from diag.agent.retention.prune import prune_incidents, prune_job_verdicts
from diag.agent.taint.evidencesources import JOB_VERDICTS_DIR
from diag.agent.taint.step import NodeTainter
from diag.agent.taint.taintconfig import TaintMode
from diag.formats import exitcodes
from diag.formats.journalmeta import safe_job_name
from diag.formats.rundir import control_socket_path
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

CHECKPOINT_METRICS_EVERY = 5.0  # seconds
_WARNINGS = frozenset({EventKind.INCIDENT, EventKind.NO_STEPS})


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        owners: Owners | None = None,
        *,
        launcher: Launcher | None = None,
        metrics_listener: socket.socket | None = None,
        kube_api: Any = None,
        exclusive: bool = False,
    ) -> None:
        """`launcher` starts py-spy (None: this process); `metrics_listener`, `kube_api`: made
        before a privilege drop; `exclusive`: the caller holds the run directory's agent lock."""
        self.cfg = cfg
        self.launcher = launcher
        self._metrics_listener = metrics_listener
        self._exclusive = exclusive
        self.owners = owners if owners is not None else owners_of(cfg.run_dir, cfg.trainer)
        self.observer = Observer(
            cfg.run_dir,
            cfg.job,
            warmup_cadence=cfg.policy.timeouts.warmup_cadence,
            owners=self.owners,
        )
        self.executor = Executor(
            self.observer,
            cfg.timeline,
            cfg.node,
            stop_grace=cfg.stop_grace,
            native_stacks=cfg.native_stacks,
            pyspy_timeout=cfg.pyspy_timeout,
            dump_parallel=cfg.dump_parallel,
            launcher=launcher,
        )
        self.state = WatchState()
        self.incidents = 0
        self._stop = threading.Event()
        self.observations = 0
        self.metrics: AgentMetrics | None = None
        if cfg.metrics_port is not None:
            self.metrics = AgentMetrics(
                cfg.node,
                cfg.policy.timeouts,
                job=cfg.job,
                xpu_timer=cfg.xpu_timer,
                precheck_file=cfg.precheck_metrics,
            )
            self.executor.listeners.append(self.metrics.on_incident)
        self.checkpoints = CheckpointManager(
            cfg.run_dir,
            safe_job_name(cfg.job) if cfg.job else None,
            cfg.checkpoint,
            owners=self.owners,
        )
        if cfg.policy.persist_on_incident:
            self.executor.persist_hooks.append(self.persist_on_incident)
        self.executor.listeners.append(self.dump_fallback)
        self.executor.listeners.append(self.prune_timeline)
        self.job_verdicts = JobVerdictStore(cfg.timeline / JOB_VERDICTS_DIR)
        self.job_link = JobLink(self.job_verdicts, cfg.node)
        self.job_stop = StopState()
        self._views: dict[str, dict[str, Any]] = {}  # incident id -> our ranks at its verdict
        # The job verdict needs the incident directory, not the slower native stacks.
        self.executor.on_disk.append(self.file_job_report)
        self.executor.listeners.append(self.job_link.captured)
        self.health: HealthWatch | None = None
        if cfg.taint.mode != TaintMode.OFF:
            h = cfg.taint.health
            self.health = HealthWatch(
                monitors_for(h, cfg.node, xid_memory=cfg.taint.policy.expiry),
                cfg.taint.policy,
                h.interval,
            )
        self.tainter = NodeTainter(
            cfg.taint,
            cfg.node,
            cfg.timeline,
            self.job_verdicts,
            health=self.health.current if self.health is not None else tuple,
            api=kube_api,
        )
        self.executor.listeners.append(self.tainter.on_incident)
        self.control: ControlServer | None = None
        self.notes = RankNotes(cfg.node, self.checkpoints.sessions)
        self.replicator: Replicator | None = None
        self.handoff: Handoff | None = None
        self._checkpoint_fed = float("-inf")
        self.drainer = (
            Drainer(self.checkpoints, cfg.drain, prover=self.observer.prover)
            if cfg.drain is not None
            else None
        )
        self.drains = Drains(self.drainer, cfg, self._stop)

    def persist_on_incident(self, verdict: Verdict) -> None:
        persist_before_acting(self.checkpoints, self.observer)

    def dump_fallback(self, report: IncidentReport) -> None:
        ask_own_dumps(self.checkpoints, report)

    def file_job_report(self, report: IncidentReport) -> None:
        """Files this node's report for the job verdict when it is first-hand, or later when no
        first-hand report comes (joblink.py); the node that claims the incident first assembles
        the verdict (in a thread)."""
        view = self._views.pop(report.verdict.incident_id, None)
        self.job_link.on_disk(report, view)

    def prune_timeline(self, report: IncidentReport | None = None) -> None:
        """Retention of the incident directories (at start-up and after each incident); the
        incident just written is kept whatever the limits."""
        current = [report.evidence.path.name] if report and report.evidence else []
        now = time.time()
        prune_incidents(
            self.cfg.timeline, self.cfg.retention, now, node=self.cfg.node, protected=current
        )
        prune_job_verdicts(self.cfg.timeline, self.cfg.retention, now)

    def request_stop(self) -> None:
        self._stop.set()

    def request_drain(self, request: DrainRequest) -> None:
        self.drains.request(request)

    def step(self, now: float) -> list[EventKind]:
        t0 = time.perf_counter()
        obs = self.observer.observe(now)
        self.observations += 1
        decision = decide(self.state, obs, self.cfg.policy)
        if decision.verdict is not None:
            wall = time.time()
            # Before any evidence is written: the job incident this one belongs to names it.
            verdict = self.job_link.resolve(
                decision.verdict, obs, obs.job or self.cfg.job or "", wall
            )
            decision = _under(decision, verdict)
            # Our ranks as they are now travel with our report for the job verdict, if we file
            # one: whoever assembles it can weigh them against the other nodes'.
            self._views[verdict.incident_id] = view_document(obs, self.cfg.node, wall)
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
        if self.metrics is not None:
            self._feed_checkpoint_metrics(now)
            self.metrics.iteration_done(time.perf_counter() - t0)
        return [e.kind for e in decision.events]

    def _follow_job(self, obs: Observation, decision: Decision, now: float) -> Decision:
        """With no incident of its own, the ranks stop with the rest of the job when another
        node's incident breaks it (jobstop.py): the same actions as a verdict of this node's."""
        job = obs.job or self.cfg.job or ""
        wall = time.time()
        incident = decision.state.incident
        local = Local(
            node=self.cfg.node,
            attempt=obs.attempt,
            live_ranks=sum(r.alive for r in obs.ranks),
            since_wall=ranks_since_wall(obs, wall),
            open_incident=incident.incident_id if incident is not None else None,
            stop=self.cfg.policy.on_hang == OnHang.STOP and bool(job),
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
        return open_incident(decision.state, obs, self.cfg.policy, verdict, decision.events)

    def _feed_checkpoint_metrics(self, now: float) -> None:
        # Snapshot headers live in /dev/shm and the committed step on storage: cheap, but not
        # worth reading every iteration.
        if self.metrics is None or now - self._checkpoint_fed < CHECKPOINT_METRICS_EVERY:
            return
        self._checkpoint_fed = now
        for r in self.checkpoints.stats().ranks:
            self.metrics.checkpoint.update(
                rank=r.rank,
                memory_step=r.memory_step,
                persisted_step=r.persisted_step,
                save_seconds=r.last_copy_seconds or None,
                persist_seconds=r.last_persist_seconds or None,
                persist_bytes=r.last_persist_bytes or None,
            )
        self.metrics.replica.update(replica_facts(self.replicator, self.handoff, self.notes))

    def run(self) -> int:
        cfg = self.cfg
        log.info(
            "watching %s (timeline %s, hang limit <= %gs, on hang: %s)",
            cfg.run_dir,
            cfg.timeline,
            cfg.policy.timeouts.ceiling,
            cfg.policy.on_hang.value,
        )
        if self.launcher is None and not can_trace():
            log.warning(
                "no ptrace permission: stack dumps will fail; run as root or add SYS_PTRACE"
            )
        self.prune_timeline()
        server = self._serve_metrics()
        if self.health is not None:
            self.health.start(self.tainter.plan_health)
        self._start_replicas()
        if cfg.control:
            path = cfg.control_socket or control_socket_path(cfg.run_dir, cfg.job)
            self.control = ControlServer(
                path, self.checkpoints, owners=self.owners, exclusive=self._exclusive,
                notes=self.notes,
            ).start()  # fmt: skip
        ended = False
        notices = (
            NoticeWatcher(cfg.notice, self.drains.on_notice).start()
            if cfg.notice is not None and self.drainer is not None
            else None
        )
        try:
            while not self._stop.is_set():
                request = self.drains.pending
                if request is not None:
                    if self.drains.run(request):
                        break
                    continue
                kinds = self.step(time.monotonic())
                self.checkpoints.tick(time.monotonic())
                if cfg.until == Until.INCIDENT and self.incidents:
                    break
                if cfg.until == Until.JOB_END and EventKind.JOB_ENDED in kinds:
                    ended = True
                    break
                self.observer.wait(cfg.interval)
        finally:
            if notices is not None:
                notices.close()
            # After a drain, what is left of the grace period bounds the clean-up: the kubelet
            # SIGKILLs at its end anyway.
            left = self._time_left()
            self.executor.join(timeout=min(cfg.stop_grace + 5, left))
            # An incident whose culprit its own node did not blame waits for the job verdict.
            self.tainter.join(timeout=min(self.tainter.job_verdict_wait + 10, left))
            if self.health is not None:
                self.health.close(timeout=min(10, left))
            self.job_link.join(timeout=min(self.job_link.longest_wait, self._time_left()))
            if self.control is not None:
                self.control.stop()
            if self.handoff is not None:
                self.handoff.close()
            if self.replicator is not None:
                self.replicator.close()
            self.checkpoints.close(timeout=min(60, left))
            self.checkpoints.tick(time.monotonic(), final=ended)
            self.observer.close()
            if server is not None:
                server.close()
            if self.metrics is not None:
                self.metrics.close()
        drained = self.drains.drained
        if drained is not None and drained.outcome.startswith("deadline reached:"):
            return exitcodes.DRAIN_INCOMPLETE
        return exitcodes.HANG_DETECTED if self.incidents and cfg.until != Until.FOREVER else 0

    def _start_replicas(self) -> None:
        self.replicator = start_replication(self.cfg, self.owners, self.checkpoints)
        if self.replicator is not None:
            self.handoff = Handoff(self.replicator, self.checkpoints)
            self.checkpoints.stopped_hooks.append(self.handoff.ranks_stopped)
            connect_ranks(self.replicator, self.notes)

    def _time_left(self) -> float:
        return self.drains.time_left()

    def _serve_metrics(self) -> MetricsServer | None:
        if self.metrics is None:
            return None
        return serve_metrics(self.cfg, self.metrics, self._metrics_listener)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_mod.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
    with AgentStart(cfg) as start:
        agent = Agent(
            start.cfg,
            start.owners,
            launcher=start.launcher,
            metrics_listener=start.metrics_listener,
            kube_api=start.kube_api,
            exclusive=True,
        )

        def on_signal(signum: int, frame: FrameType | None) -> None:
            # Only flags here: the main loop logs and acts.
            if signum == signal.SIGTERM and agent.drainer is not None:
                agent.request_drain(DrainRequest("SIGTERM", time.monotonic()))
            else:
                agent.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        return agent.run()
