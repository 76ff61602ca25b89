"""What the agent does for the ranks' checkpoints and stacks at an incident, beside the evidence:
persist the newest in-memory checkpoints before anything is stopped, and ask the ranks py-spy
could not dump to write their own stacks."""

from __future__ import annotations

import logging
import time

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.sessions import CommandKind
from diag.agent.evidence.collection import IncidentReport
from diag.agent.observe.observer import Observer
from diag.formats.journalmeta import safe_job_name

log = logging.getLogger(__name__)


def persist_before_acting(checkpoints: CheckpointManager, observer: Observer) -> None:
    """Before anything is killed: the newest complete in-memory checkpoints of the jobs whose
    ranks are involved go to storage (a no-op for jobs without flash checkpoints)."""
    jobs = {safe_job_name(t.meta.job) for t in observer.current()}
    t0 = time.monotonic()
    results = checkpoints.persist_all_jobs(jobs)
    if results:
        done = sorted({(r.job, r.step) for r in results if r.ok})
        log.warning(
            "persisted %d in-memory checkpoint part(s) in %.2f s before acting: %s",
            sum(r.ok for r in results),
            time.monotonic() - t0,
            ", ".join(f"{j} step {s}" for j, s in done) or "none usable",
        )


def ask_own_dumps(checkpoints: CheckpointManager, report: IncidentReport) -> None:
    """Ranks py-spy could not dump write their own Python stacks into the incident."""
    if report.evidence is None:
        return
    failed = [d.rank for d in report.evidence.dumps if d.error]
    job = safe_job_name(report.job) if report.job else ""
    if not failed or not job:
        return
    sent = checkpoints.send_command(
        job, CommandKind.DUMP, failed, reason=report.verdict.summary,
        dump_dir=str(report.evidence.path),
    )  # fmt: skip
    if sent:
        log.warning("asked ranks %s to dump their own stacks", sorted(sent))
