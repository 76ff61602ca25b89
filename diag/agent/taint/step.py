"""The agent's taint step. An agent taints its own node only, so a job-wide hang makes one taint,
not one per node. It plans (and, with `--taint-mode on`, applies) when
- an incident it took part in names a rank of this node: its own verdict blames one of its ranks,
  or, when it did not (a deadlock in which none of its ranks stood out, or its ranks only waited
  for other nodes), the job verdict of that incident names this node as the culprit's;
- its node-health monitors say something new (`health/watch.py`).

Every plan weighs all of the node's evidence: the incidents naming it within the culprit window
(its own incident directories and the job verdicts), and what the health monitors see now.
It runs on threads of its own: a slow API server never delays stopping the ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from diag.agent.evidence.collection import IncidentReport
from diag.agent.job.decisions import DEATH
from diag.agent.job.verdict import JobVerdict, JobVerdictStore
from diag.agent.taint.evidencesources import (
    JOB_VERDICTS_DIR,
    a_victim,
    culprit_history,
    from_job_verdict,
)
from diag.agent.taint.flow import TaintOutcome, taint
from diag.agent.taint.kube import KubeError
from diag.agent.taint.ledger import LedgerBusy
from diag.agent.taint.model import Evidence, Signal
from diag.agent.taint.taintconfig import TaintMode, TaintSettings
from diag.formats.incidentdir import incident_id_of

log = logging.getLogger(__name__)

# How long past the job verdict's settle time an agent waits for it: the claimant lists the
# reports and writes the verdict then.
JOB_VERDICT_SLACK = 20.0
_FIRST_LOOK, _LONGEST_PAUSE = 0.5, 4.0


class NodeTainter:
    def __init__(
        self,
        settings: TaintSettings,
        node: str,
        timeline: Path,
        job_verdicts: JobVerdictStore | None = None,
        health: Callable[[], Sequence[Evidence]] = tuple,
        clock: Callable[[], float] = time.time,
        job_verdict_slack: float = JOB_VERDICT_SLACK,
        api: Any = None,
    ) -> None:
        self.settings = settings
        # A Kubernetes client made before the agent gave up root (its credentials may be
        # root's to read); None: one is made for every plan.
        self.api = api
        self.node = node  # in the job: incidents and verdicts name it
        self.kube_node = settings.kube_node or node  # in Kubernetes: the node its taint goes on
        self.timeline = timeline
        self.job_verdicts = job_verdicts or JobVerdictStore(timeline / JOB_VERDICTS_DIR)
        self.health = health
        self.clock = clock
        self.job_verdict_slack = job_verdict_slack
        self.outcomes: list[TaintOutcome] = []
        self._threads: list[threading.Thread] = []
        self._plan_lock = threading.Lock()  # one plan at a time: incidents and health signals

    @property
    def job_verdict_wait(self) -> float:
        return self.job_verdicts.settle + self.job_verdict_slack

    def on_incident(self, report: IncidentReport) -> None:
        if self.settings.mode == TaintMode.OFF or report.evidence is None:
            return
        t = threading.Thread(target=self._run, args=(report,), name="diag-taint", daemon=True)
        self._threads.append(t)
        t.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, report: IncidentReport) -> None:
        ev = self.incident_evidence(report)
        if ev is None:
            return
        self.plan([ev], job=report.job)

    def incident_evidence(self, report: IncidentReport) -> Evidence | None:
        """CULPRIT evidence against this node for the incident, or None when it names another
        node (or nobody, or its job verdict did not come in time)."""
        assert report.evidence is not None
        v = report.verdict
        incident = incident_id_of(report.job, v.incident_id)
        path = str(report.evidence.path)
        local = {d.rank for d in report.evidence.dumps}
        if v.culprit is not None and v.culprit in local:
            if v.kind.value == DEATH and self._victim(report.job, v.incident_id):
                return None
            return Evidence(
                Signal.CULPRIT,
                self.clock(),
                f"rank {v.culprit}: {v.summary[:200]}",
                incident_id=incident,
                incident_path=path,
            )
        verdict = self.await_job_verdict(report.job, v.incident_id)
        if verdict is None:
            log.warning(
                "taint: no job verdict for %s within %g s: this incident counts against no node",
                incident,
                self.job_verdict_wait,
            )
            return None
        ev = from_job_verdict(verdict, report.job, self.node, self.clock(), path)
        if ev is None:
            log.info(
                "taint: the job verdict of %s names rank %s on node %s, not this node",
                incident,
                verdict.culprit,
                verdict.culprit_node or "?",
            )
        return ev

    def _victim(self, job: str, incident_id: str) -> bool:
        """A death of this node's rank that the job verdict puts on a node that went silent
        (a whole node lost: this rank died because its peer vanished). Without a job verdict
        in time, the death counts against this node as its own verdict says."""
        verdict = self.await_job_verdict(job, incident_id)
        if verdict is None or not a_victim(verdict, self.node):
            return False
        log.warning(
            "taint: rank of this node died after node %s went silent (job verdict of %s): "
            "this incident counts against %s, not this node",
            verdict.culprit_node, incident_id, verdict.culprit_node,
        )  # fmt: skip
        return True

    def await_job_verdict(self, job: str, incident_id: str) -> JobVerdict | None:
        """The job verdict of the incident, read until it is there, at most `job_verdict_wait`
        seconds; the pauses between looks double (a few reads per agent, whatever the job's
        size)."""
        deadline = time.monotonic() + self.job_verdict_wait
        pause = _FIRST_LOOK
        while True:
            try:
                verdict = self.job_verdicts.load(job, incident_id)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("unreadable job verdict of %s: %s", incident_id, e)
                verdict = None
            if verdict is not None:
                return verdict
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, _LONGEST_PAUSE)

    def plan_health(self, evidence: Sequence[Evidence]) -> bool:
        """For the health watch: plan with what the monitors see now."""
        return self.plan((), health=evidence) is not None

    def plan(
        self,
        extra: Sequence[Evidence],
        *,
        job: str = "",
        health: Sequence[Evidence] | None = None,
    ) -> TaintOutcome | None:
        """Plans (and applies, unless a dry run) this node's taint from all its evidence; None
        when that failed (the reason is logged)."""
        settings = self.settings
        if job:
            settings = replace(settings, policy=replace(settings.policy, job=job))
        since = self.clock() - settings.policy.culprit_window
        dry_run = settings.mode == TaintMode.DRY_RUN
        with self._plan_lock:
            try:
                evidence = [
                    *extra,
                    *culprit_history(self.timeline, self.node, since),
                    *(self.health() if health is None else health),
                ]
                out = taint(
                    settings,
                    self.kube_node,
                    self.timeline,
                    evidence,
                    dry_run=dry_run,
                    api=self.api,
                )
            except (KubeError, LedgerBusy, OSError) as e:
                log.error("taint of node %s failed: %s", self.kube_node, e)
                return None
            except Exception as e:  # the Kubernetes client's own configuration errors
                log.error("taint of node %s failed: %s", self.kube_node, e)
                return None
        self.outcomes.append(out)
        prefix = "taint plan (dry run)" if dry_run else "taint"
        level = logging.WARNING if out.plan.changes_node else logging.INFO
        log.log(level, "%s:\n%s", prefix, out.plan.describe())
        return out
