"""The agent's taint step: after an incident's evidence is on disk, the agent whose node ran the
culprit rank plans (and, with `--taint-mode on`, applies) its own node's taint. Agents on other
nodes do nothing, so a job-wide hang makes one taint, not one per node.

It runs on a thread of its own: a slow API server never delays stopping the ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

from diag.agent.actions import IncidentReport
from diag.agent.kube import KubeError
from diag.agent.taintconfig import TaintMode, TaintSettings
from diag.agent.taintevidence import from_timeline
from diag.agent.taintflow import TaintOutcome, taint
from diag.agent.taintledger import LedgerBusy

log = logging.getLogger(__name__)


class NodeTainter:
    def __init__(self, settings: TaintSettings, node: str, timeline: Path) -> None:
        self.settings = settings
        self.node = node
        self.timeline = timeline
        self.outcomes: list[TaintOutcome] = []
        self._threads: list[threading.Thread] = []

    def on_incident(self, report: IncidentReport) -> None:
        if self.settings.mode == TaintMode.OFF or report.verdict.culprit is None:
            return
        t = threading.Thread(target=self._run, args=(report,), name="diag-taint", daemon=True)
        self._threads.append(t)
        t.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, report: IncidentReport) -> None:
        settings = self.settings
        if report.job:
            settings = replace(settings, policy=replace(settings.policy, job=report.job))
        now = time.time()
        evidence = from_timeline(self.timeline, self.node, now - settings.policy.culprit_window)
        if report.evidence is not None and not any(
            e.incident_path == str(report.evidence.path) for e in evidence
        ):
            log.debug("taint: the culprit of %s is not on this node", report.evidence.path)
            return
        dry_run = settings.mode == TaintMode.DRY_RUN
        try:
            out = taint(settings, self.node, self.timeline, evidence, dry_run=dry_run)
        except (KubeError, LedgerBusy, OSError) as e:
            log.error("taint of node %s failed: %s", self.node, e)
            return
        except Exception as e:  # the Kubernetes client's own configuration errors
            log.error("taint of node %s failed: %s", self.node, e)
            return
        self.outcomes.append(out)
        prefix = "taint plan (dry run)" if dry_run else "taint"
        log.warning("%s:\n%s", prefix, out.plan.describe())
