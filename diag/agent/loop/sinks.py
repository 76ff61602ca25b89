"""What happens after a verdict, in one place: the sinks an incident goes through, in order.

An incident has three moments (`Stage`), and the executor (cycle.py) calls the sinks of each
in the order `incident_sinks` lists them, every one whatever another raised:

1. BEFORE_EVIDENCE, the verdict only, before anything is dumped or stopped:
   - checkpoints: the newest complete in-memory snapshots of the jobs involved go to storage;
2. ON_DISK, as soon as the incident directory holds every rank's Python stack (the native
   stacks come later):
   - job verdict: this node's report for the job verdict, filed at once when first-hand;
3. CAPTURED, the evidence complete, before the ranks are stopped (when `--on-hang stop`):
   - metrics: the incident counters and the evidence's timings;
   - self-dump: ranks py-spy could not dump are asked to write their own Python stacks;
   - job verdict: the incident is known to the node's job link (a later report, the verdict);
   - taint: this node tainted when the verdict, or the job's, names one of its ranks (on a
     thread of its own: it may wait for the job verdict);
   - retention: old incidents pruned (never this one).

A sink is plain data: a name, a stage and what to call. Its parts (the checkpoint manager, the
job link, the tainter, the metrics) are built by the agent (daemon.py) and handed in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.sessions import CommandKind
from diag.agent.evidence.collection import IncidentReport
from diag.agent.job.link import JobLink
from diag.agent.metrics.exporter import AgentMetrics
from diag.agent.observe.observer import Observer
from diag.agent.retention.policy import Retention
from diag.agent.retention.prune import prune_incidents, prune_job_verdicts
from diag.agent.taint.step import NodeTainter
from diag.formats.journalmeta import safe_job_name

log = logging.getLogger(__name__)


class Stage(Enum):
    BEFORE_EVIDENCE = "before evidence"  # the report carries no evidence yet
    ON_DISK = "on disk"  # the incident directory with every rank's Python stack
    CAPTURED = "captured"  # the evidence complete; the ranks not stopped yet


@dataclass(frozen=True)
class Sink:
    name: str
    stage: Stage
    take: Callable[[IncidentReport], None]


def deliver(sinks: Sequence[Sink], stage: Stage, report: IncidentReport) -> None:
    """Every sink of `stage`, in order; one that raises is logged and the next still runs."""
    for sink in sinks:
        if sink.stage is not stage:
            continue
        try:
            sink.take(report)
        except Exception:
            log.exception("incident sink %s failed", sink.name)


@dataclass(frozen=True)
class SinkParts:
    """What the sinks act through, as the agent built it."""

    observer: Observer
    checkpoints: CheckpointManager
    job_link: JobLink
    tainter: NodeTainter
    metrics: AgentMetrics | None
    timeline: Path
    node: str
    retention: Retention
    persist_on_incident: bool
    views: dict[str, dict[str, Any]]  # incident id -> our ranks at its verdict (job link)


def incident_sinks(p: SinkParts) -> tuple[Sink, ...]:
    """The sinks of an incident, in the order they run (the module's docstring says why)."""
    sinks: list[Sink] = []
    if p.persist_on_incident:
        sinks.append(Sink("checkpoints", Stage.BEFORE_EVIDENCE, lambda r: persist(p, r)))
    sinks.append(Sink("job report", Stage.ON_DISK, lambda r: file_job_report(p, r)))
    if p.metrics is not None:
        sinks.append(Sink("metrics", Stage.CAPTURED, p.metrics.on_incident))
    sinks.append(Sink("self-dump", Stage.CAPTURED, lambda r: ask_for_own_stacks(p, r)))
    sinks.append(Sink("job verdict", Stage.CAPTURED, p.job_link.captured))
    sinks.append(Sink("taint", Stage.CAPTURED, p.tainter.on_incident))
    sinks.append(Sink("retention", Stage.CAPTURED, lambda r: prune(p, r)))
    return tuple(sinks)


def persist(p: SinkParts, report: IncidentReport) -> None:
    """Before anything is killed: the newest complete in-memory checkpoints of the jobs whose
    ranks are involved go to storage (a no-op for jobs without flash checkpoints)."""
    jobs = {safe_job_name(t.meta.job) for t in p.observer.current()}
    t0 = time.monotonic()
    results = p.checkpoints.persist_all_jobs(jobs)
    if results:
        done = sorted({(r.job, r.step) for r in results if r.ok})
        log.warning(
            "persisted %d in-memory checkpoint part(s) in %.2f s before acting: %s",
            sum(r.ok for r in results),
            time.monotonic() - t0,
            ", ".join(f"{j} step {s}" for j, s in done) or "none usable",
        )


def file_job_report(p: SinkParts, report: IncidentReport) -> None:
    """Files this node's report for the job verdict when it is first-hand, or later when no
    first-hand report comes (job/link.py); the node that claims the incident first assembles
    the verdict (in a thread)."""
    view = p.views.pop(report.verdict.incident_id, None)
    p.job_link.on_disk(report, view)


def ask_for_own_stacks(p: SinkParts, report: IncidentReport) -> None:
    """Ranks py-spy could not dump write their own Python stacks into the incident."""
    if report.evidence is None:
        return
    failed = [d.rank for d in report.evidence.dumps if d.error]
    job = safe_job_name(report.job) if report.job else ""
    if not failed or not job:
        return
    sent = p.checkpoints.send_command(
        job, CommandKind.DUMP, failed, reason=report.verdict.summary,
        dump_dir=str(report.evidence.path),
    )  # fmt: skip
    if sent:
        log.warning("asked ranks %s to dump their own stacks", sorted(sent))


def prune(p: SinkParts, report: IncidentReport | None = None) -> None:
    """Retention of the incident directories (at start-up and after each incident); the
    incident just written is kept whatever the limits."""
    current = [report.evidence.path.name] if report and report.evidence else []
    now = time.time()
    prune_incidents(p.timeline, p.retention, now, protected=current, node=p.node)
    prune_job_verdicts(p.timeline, p.retention, now)
