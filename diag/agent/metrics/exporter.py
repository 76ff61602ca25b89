"""The agent's metrics: one registry, fed by the loop, read by scrapes.

Two ways in, chosen for cost:
- per-rank state, bus bandwidth, straggler scores, open incidents, host, GPU and the agent
  itself are computed when a scrape asks, from the latest observation the loop left here (no
  work between scrapes, no stale series for ranks that went away);
- collective latencies, bytes and incident counts are cumulative, so the loop feeds them
  incrementally: only the completions that are new since its last check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from diag.agent.detect.hang import Verdict, VerdictKind, WatchState
from diag.agent.detect.observation import Observation, OpView
from diag.agent.detect.straggler import straggler_scores
from diag.agent.detect.timeouts import TimeoutPolicy
from diag.agent.evidence.collection import IncidentReport
from diag.agent.metrics import families as f
from diag.agent.metrics.checkpoint import CheckpointMetrics
from diag.agent.metrics.collectives import Bandwidth, bus_bandwidth, new_completions, op_kind
from diag.agent.metrics.exposition import TextWriter
from diag.agent.metrics.gpu import GpuCollector, Nvml, open_nvml
from diag.agent.metrics.host import HostCollector
from diag.agent.metrics.prechecktext import PrecheckFileCollector
from diag.agent.metrics.rankstate import RankMetrics, rank_metrics
from diag.agent.metrics.replicastats import ReplicaMetrics
from diag.agent.metrics.xputimer import XpuTimerIdentity, render

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Latest:
    obs: Observation
    incident: Verdict | None
    job: str


@dataclass(frozen=True)
class _Derived:
    """What scrapes compute from one observation; cached until the next one arrives."""

    latest: _Latest
    ranks: tuple[RankMetrics, ...]
    busbw: tuple[Bandwidth, ...]


class AgentMetrics:
    def __init__(
        self,
        node: str,
        timeouts: TimeoutPolicy,
        *,
        job: str | None = None,
        xpu_timer: XpuTimerIdentity | None = None,
        precheck_file: Path | None = None,
        gpu: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.timeouts = timeouts
        self.xpu_timer = xpu_timer
        self.clock = clock
        self._job = job or ""
        # `_created` series double a scrape for no use here; this process has no other metrics.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.latency = _histogram(f.COLL_LATENCY, reg)
        self.bytes = _counter(f.COLL_BYTES, reg)
        self.incidents = _counter(f.INCIDENTS, reg)
        self.job_stops = _counter(f.JOB_STOPS, reg)
        self.in_place = _counter(f.IN_PLACE, reg)
        self.detection_delay = _histogram(f.DETECTION_DELAY, reg)
        self.evidence = _histogram(f.EVIDENCE_SECONDS, reg)
        self.iterations = _counter(f.AGENT_ITERATIONS, reg).labels(node)
        self.iteration_seconds = _counter(f.AGENT_ITERATION_SECONDS, reg).labels(node)
        self.checkpoint = CheckpointMetrics(lambda: self.job, node, clock)
        reg.register(self.checkpoint)
        self.replica = ReplicaMetrics(lambda: self.job, node)
        reg.register(self.replica)
        reg.register(_StateCollector(self))
        reg.register(HostCollector(node))
        self.nvml: Nvml | None = open_nvml() if gpu else None
        if self.nvml is not None:
            reg.register(GpuCollector(node, self.nvml))
        if precheck_file is not None:
            reg.register(PrecheckFileCollector(precheck_file))
        self._latest: _Latest | None = None
        self._derived: _Derived | None = None
        self._last_seen: dict[int, OpView] = {}
        self._children: dict[tuple[str, int, int, str], tuple] = {}
        self._jobs_seen: set[str] = set()
        self._last_iteration = 0.0
        self._last_incident: float | None = None
        self._lock = threading.Lock()
        self._writer = TextWriter()
        self._init_job(self._job)

    @property
    def job(self) -> str:
        return self._job

    # -- fed by the loop -------------------------------------------------------------------------

    def update(self, obs: Observation, state: WatchState, verdict: Verdict | None = None) -> None:
        """After each decision, before its actions run, so an incident shows at once."""
        if obs.job and obs.job != self._job:
            self._job = obs.job
            self._init_job(obs.job)
        if verdict is not None:
            self._count_verdict(verdict)
        self._observe_ops(obs)
        self._latest = _Latest(obs, state.incident, self._job)

    def iteration_done(self, seconds: float) -> None:
        self.iterations.inc()
        self.iteration_seconds.inc(seconds)
        self._last_iteration = self.clock()

    def on_incident(self, report: IncidentReport) -> None:
        """Executor listener: called once the evidence is on disk."""
        ev = report.evidence
        if ev is None:
            return
        job = report.job or self._job
        self.evidence.labels(job, self.node, "on_disk").observe(ev.on_disk_seconds)
        self.evidence.labels(job, self.node, "complete").observe(ev.total_seconds)

    def job_stop(self, trigger: str) -> None:
        """The local ranks stop for another node's incident (`job/jobstop.py`)."""
        self.job_stops.labels(self._job, self.node, trigger).inc()

    def recover_in_place(self, job: str, took: int, stopped: int, not_asked: int) -> None:
        """One RECOVER round's outcome (`loop/inplace.py`)."""
        for outcome, n in (("took", took), ("stopped", stopped), ("not_asked", not_asked)):
            self.in_place.labels(job or self._job, self.node, outcome).inc(n)

    def _init_job(self, job: str) -> None:
        # Counters start at 0 so the first incident is an increase that rules can see.
        if not job or job in self._jobs_seen:
            return
        self._jobs_seen.add(job)
        for kind in VerdictKind:
            self.incidents.labels(job, self.node, kind.value)

    def _count_verdict(self, verdict: Verdict) -> None:
        self.incidents.labels(self._job, self.node, verdict.kind.value).inc()
        if verdict.expired_at is not None:
            delay = max(0.0, verdict.at - verdict.expired_at)
            self.detection_delay.labels(self._job, self.node).observe(delay)
        self._last_incident = self.clock()

    def _observe_ops(self, obs: Observation) -> None:
        local = {r.rank: r.local_rank for r in obs.ranks}
        job = self._job
        for rank, ops in obs.recent_ops.items():
            if not ops:
                continue
            for op in new_completions(self._last_seen.get(rank), ops):
                key = (job, rank, local.get(rank, -1), op_kind(op.op))
                children = self._children.get(key)
                if children is None:
                    labels = (job, self.node, str(rank), str(key[2]), key[3])
                    children = (self.latency.labels(*labels), self.bytes.labels(*labels))
                    self._children[key] = children
                if op.t_end is not None:
                    children[0].observe(max(0.0, op.t_end - op.t_enqueue))
                children[1].inc(op.nbytes)
            self._last_seen[rank] = ops[-1]

    # -- read by scrapes -------------------------------------------------------------------------

    def derived(self) -> _Derived | None:
        latest = self._latest
        if latest is None:
            return None
        cached = self._derived
        if cached is not None and cached.latest is latest:
            return cached
        with self._lock:  # two concurrent scrapes compute it once
            cached = self._derived
            if cached is not None and cached.latest is latest:
                return cached
            obs = latest.obs
            scores = straggler_scores(obs.recent_ops)
            ranks = rank_metrics(obs, self.timeouts, latest.incident, scores)
            busbw = tuple(bus_bandwidth(obs.recent_ops, obs.groups))
            self._derived = _Derived(latest, ranks, busbw)
            return self._derived

    def render(self) -> bytes:
        """The scrape: every family, plus xpu_timer's hang gauge when asked for."""
        body = self._writer.render(self.registry)
        if self.xpu_timer is not None:
            d = self.derived()
            body += render(self.xpu_timer, d.ranks if d else ()).encode()
        return body

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None


class _StateCollector(Collector):
    """Per-rank gauges, bus bandwidth, open incidents and the loop's heartbeat."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        d = m.derived()
        yield from _rank_families(d, m.node)
        busbw = f.COLL_BUSBW.new()
        opened = f.INCIDENT_OPEN.new()
        last = f.INCIDENT_TIME.new()
        beat = f.AGENT_LAST_ITERATION.new()
        if d is not None:
            job = d.latest.job
            local = {r.rank: r.local_rank for r in d.ranks}
            for b in d.busbw:
                labels = [job, m.node, str(b.rank), str(local.get(b.rank, -1)), b.kind]
                busbw.add_metric(labels, b.bytes_per_second)
            open_kind = d.latest.incident.kind if d.latest.incident else None
            for kind in VerdictKind:
                opened.add_metric([job, m.node, kind.value], float(kind == open_kind))
            if m._last_incident is not None:
                last.add_metric([job, m.node], m._last_incident)
        if m._last_iteration:
            beat.add_metric([m.node], m._last_iteration)
        yield from (busbw, opened, last, beat)


def _rank_families(d: _Derived | None, node: str) -> Iterator[Metric]:
    getters: tuple[tuple[f.Family, Callable[[RankMetrics], float | None]], ...] = (
        (f.RANK_ALIVE, lambda r: float(r.alive)),
        (f.RANK_STEP, lambda r: r.step),
        (f.RANK_STEP_SECONDS, lambda r: r.step_seconds),
        (f.RANK_SINCE_PROGRESS, lambda r: r.since_progress),
        (f.RANK_HANG_LIMIT, lambda r: r.hang_limit),
        (f.RANK_HUNG, lambda r: float(r.hung)),
        (f.RANK_CULPRIT, lambda r: float(r.culprit)),
        (f.RANK_PENDING, lambda r: r.pending_ops),
        (f.RANK_CPU, lambda r: r.cpu_ratio),
        (f.STRAGGLER_SCORE, lambda r: r.straggler_score),
        (f.STRAGGLER_LATE, lambda r: r.straggler_late),
        (f.STRAGGLER_WAIT_SHARE, lambda r: r.straggler_wait_share),
    )
    for fam, get in getters:
        m = fam.new()
        if d is not None:
            for r in d.ranks:
                value = get(r)
                if value is not None:
                    m.add_metric([d.latest.job, node, str(r.rank), str(r.local_rank)], value)
        yield m


def _histogram(fam: f.Family, registry: CollectorRegistry) -> Histogram:
    return Histogram(fam.name, fam.help, fam.labels, registry=registry, buckets=fam.buckets)


def _counter(fam: f.Family, registry: CollectorRegistry) -> Counter:
    return Counter(fam.name, fam.help, fam.labels, registry=registry)
