"""`diag agent`: the sidecar's main loop. Observe, decide (pure core), execute, repeat.

The loop sleeps in poll() on the ranks' pidfds between checks, so a rank's death wakes it at once;
everything else is seen within one `--interval`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.ranknotes import RankNotes
from diag.agent.checkpoint.service import ControlServer
from diag.agent.config.agentconfig import AgentSettings
from diag.agent.config.options import Until
from diag.agent.detect.hang import (
    EventKind,
)
from diag.agent.drain.executor import Drainer
from diag.agent.drain.notice import Notice, NoticeWatcher, deadline_of
from diag.agent.drain.plan import DrainRequest, DrainState
from diag.agent.evidence.pyspy import Launcher, can_trace
from diag.agent.health.monitors import monitors_for
from diag.agent.health.watch import HealthWatch
from diag.agent.job.link import JobLink
from diag.agent.job.verdict import JobVerdictStore
from diag.agent.loop.cycle import Cycle, Executor
from diag.agent.loop.peerwatch import PeerWatch
from diag.agent.loop.replication import (
    Handoff,
    connect_ranks,
    replica_facts,
    start_replication,
)
from diag.agent.loop.sinks import SinkParts, incident_sinks, prune
from diag.agent.metrics.exporter import AgentMetrics
from diag.agent.metrics.server import MetricsServer
from diag.agent.observe.observer import Observer
from diag.agent.observe.rundircheck import owners_of
from diag.agent.replica.replicator import Replicator
from diag.agent.taint.evidencesources import JOB_VERDICTS_DIR
from diag.agent.taint.step import NodeTainter
from diag.agent.taint.taintconfig import TaintMode
from diag.formats import exitcodes
from diag.formats.journalmeta import safe_job_name
from diag.formats.rundir import control_socket_path
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

CHECKPOINT_METRICS_EVERY = 5.0  # seconds


class Agent:
    def __init__(
        self,
        cfg: AgentSettings,
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
        self._stop = threading.Event()
        self.metrics: AgentMetrics | None = None
        if cfg.metrics_port is not None:
            self.metrics = AgentMetrics(
                cfg.node,
                cfg.policy.timeouts,
                job=cfg.job,
                xpu_timer=cfg.xpu_timer,
                precheck_file=cfg.precheck_metrics,
            )
        self.checkpoints = CheckpointManager(
            cfg.run_dir,
            safe_job_name(cfg.job) if cfg.job else None,
            cfg.checkpoint,
            owners=self.owners,
        )
        self.job_verdicts = JobVerdictStore(cfg.timeline / JOB_VERDICTS_DIR)
        self.job_link = JobLink(self.job_verdicts, cfg.node)
        self._views: dict[str, dict[str, Any]] = {}  # incident id -> our ranks at its verdict
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
        # What happens after a verdict, in order: sinks.py.
        self.sink_parts = SinkParts(
            observer=self.observer,
            checkpoints=self.checkpoints,
            job_link=self.job_link,
            tainter=self.tainter,
            metrics=self.metrics,
            timeline=cfg.timeline,
            node=cfg.node,
            retention=cfg.retention,
            persist_on_incident=cfg.policy.persist_on_incident,
            views=self._views,
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
            sinks=incident_sinks(self.sink_parts),
            commands=self.checkpoints,
            metrics=self.metrics,
        )
        self.cycle = Cycle(
            self.observer,
            self.executor,
            self.job_link,
            cfg.policy,
            cfg.node,
            cfg.job,
            self._views,
            self.metrics,
        )
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
        self.drained: DrainState | None = None
        self._drain_lock = threading.Lock()
        self._drain_request: DrainRequest | None = None
        self._exit_after_drain = False
        self._draining = False

    def request_stop(self) -> None:
        self._stop.set()

    def request_drain(self, request: DrainRequest) -> None:
        """Asks the main loop to drain (from a signal handler or the notice watcher: it only
        records the request). A SIGTERM during an early notice's drain makes the agent exit
        once that drain is done, and brings its deadline forward to the grace period's."""
        with self._drain_lock:
            if request.exit_after:
                self._exit_after_drain = True
            if self._draining:
                if self.drainer is not None:
                    self.drainer.tighten(request)
                return
            if self._drain_request is not None:
                if _ends_sooner(request, self._drain_request, self.cfg):
                    self._drain_request = request
                return
            self._drain_request = request

    def on_notice(self, notice: Notice) -> None:
        deadline = deadline_of(notice, time.time(), time.monotonic())
        self.request_drain(
            DrainRequest(notice.describe(), time.monotonic(), deadline=deadline, exit_after=False)
        )

    def _drain(self, request: DrainRequest) -> bool:
        """Runs a drain on the main loop; True when the agent should exit afterwards."""
        assert self.drainer is not None
        with self._drain_lock:
            self._draining = True
        try:
            self.drained = self.drainer.run(request, abort=self._stop)
        finally:
            with self._drain_lock:
                self._draining = False
                self._drain_request = None
                exit_after = self._exit_after_drain
        return exit_after or self._stop.is_set()

    def step(self, now: float) -> list[EventKind]:
        """One watch cycle (cycle.py), then the checkpoint metrics."""
        t0 = time.perf_counter()
        kinds = self.cycle.step(now)
        if self.metrics is not None:
            self._feed_checkpoint_metrics(now)
            self.metrics.iteration_done(time.perf_counter() - t0)
        return kinds

    @property
    def incidents(self) -> int:
        return self.cycle.incidents

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
        prune(self.sink_parts)
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
            NoticeWatcher(cfg.notice, self.on_notice).start()
            if cfg.notice is not None and self.drainer is not None
            else None
        )
        try:
            while not self._stop.is_set():
                request = self._drain_request
                if request is not None:
                    if self._drain(request):
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
        if self.drained is not None and self.drained.outcome.startswith("deadline reached:"):
            return exitcodes.DRAIN_INCOMPLETE
        return exitcodes.HANG_DETECTED if self.incidents and cfg.until != Until.FOREVER else 0

    def _start_replicas(self) -> None:
        self.replicator = start_replication(self.cfg, self.owners, self.checkpoints)
        if self.replicator is not None:
            self.handoff = Handoff(self.replicator, self.checkpoints)
            self.checkpoints.stopped_hooks.append(self.handoff.ranks_stopped)
            connect_ranks(self.replicator, self.notes)
            # A death's claimant asks its neighbours whether their agents answer: a node lost
            # whole is the culprit, not the survivor whose rank died when its peer vanished.
            self.job_link.peers = PeerWatch(self.replicator)
            self.job_link.lost_after = min(
                self.replicator.settings.lost_after, self.job_verdicts.settle
            )

    def _time_left(self) -> float:
        d = self.drained
        if d is None:
            return float("inf")
        return max(
            0.5,
            d.deadline + (self.cfg.drain.margin if self.cfg.drain else 0) - 1.0 - time.monotonic(),
        )

    def _serve_metrics(self) -> MetricsServer | None:
        cfg = self.cfg
        if self.metrics is None or cfg.metrics_port is None:
            return None
        try:
            server = MetricsServer(
                self.metrics.render,
                cfg.metrics_host,
                cfg.metrics_port,
                listener=self._metrics_listener,
            )
        except OSError as e:
            raise exitcodes.UsageError(
                f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {e.strerror}; "
                "choose another --metrics-port (0 picks a free one)"
            ) from e
        log.info("serving metrics on http://%s:%d/metrics", cfg.metrics_host, server.port)
        return server.start()


def _ends_sooner(a: DrainRequest, b: DrainRequest, cfg: AgentSettings) -> bool:
    grace = cfg.drain.grace if cfg.drain is not None else 0.0

    def end(r: DrainRequest) -> float:
        return r.deadline if r.deadline is not None else r.at + grace

    return end(a) < end(b)
