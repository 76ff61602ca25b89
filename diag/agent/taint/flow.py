"""Plan, then apply: the taint step shared by `diag taint`, `diag untaint` and the agent.

Under the job's ledger lock: read the job's budget, read the node, plan, and (unless dry run)
apply the plan with conflict retries, then record the slot. The lock spans the apply, so the
job-wide cap holds even when several culprit nodes' agents decide at the same moment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.agent.taint.kube import ApplyResult, apply_plan, connect, read_node
from diag.agent.taint.ledger import TaintLedger
from diag.agent.taint.planner import (
    Evidence,
    JobBudget,
    NodeView,
    TaintPlan,
    plan_expiry,
    plan_taint,
    plan_untaint,
)
from diag.agent.taint.taintconfig import TaintSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaintOutcome:
    plan: TaintPlan
    dry_run: bool
    applied: bool = False
    attempts: int = 0
    event_name: str = ""
    budget: JobBudget = field(default_factory=JobBudget)


def taint(
    settings: TaintSettings,
    node: str,
    timeline: Path,
    evidence: Sequence[Evidence],
    *,
    dry_run: bool,
    api: Any = None,
    clock: Callable[[], float] = time.time,
) -> TaintOutcome:
    api = api if api is not None else connect(settings.kubeconfig)
    ledger = TaintLedger(
        timeline, settings.policy.job, settings.ledger_timeout, history=settings.history
    )

    def decide_with(budget: JobBudget) -> Callable[[NodeView], TaintPlan]:
        return lambda view: plan_taint(view, evidence, settings.policy, budget, clock())

    if dry_run:
        budget = ledger.budget(clock())
        plan = decide_with(budget)(read_node(api, node).view)
        return TaintOutcome(plan, dry_run=True, budget=budget)
    with ledger.locked():
        budget = ledger.budget(clock())
        result = apply_plan(
            api,
            node,
            decide_with(budget),
            event_namespace=settings.event_namespace,
            retries=settings.retries,
        )
        if result.applied:
            ledger.record(result.plan, clock())
    return _outcome(result, budget)


def untaint(
    settings: TaintSettings,
    node: str,
    timeline: Path,
    *,
    dry_run: bool,
    why: str,
    api: Any = None,
    clock: Callable[[], float] = time.time,
) -> TaintOutcome:
    """Remove diag's taint from `node` and give the slot back to the job that took it."""
    api = api if api is not None else connect(settings.kubeconfig)
    state = read_node(api, node)
    job = state.view.record.job if state.view.record is not None else settings.policy.job
    if dry_run:
        return TaintOutcome(plan_untaint(state.view, clock(), why), dry_run=True)
    ledger = TaintLedger(timeline, job, settings.ledger_timeout, history=settings.history)
    with ledger.locked():
        result = apply_plan(
            api,
            node,
            lambda view: plan_untaint(view, clock(), why),
            event_namespace=settings.event_namespace,
            retries=settings.retries,
        )
        if result.applied:
            ledger.record(result.plan, clock())
    return _outcome(result, JobBudget())


def expire(
    settings: TaintSettings,
    node: str,
    timeline: Path,
    *,
    dry_run: bool,
    api: Any = None,
    clock: Callable[[], float] = time.time,
) -> TaintOutcome:
    """Untaint `node` if its taint expired; anything else stays as it is."""
    api = api if api is not None else connect(settings.kubeconfig)

    def decide(view: NodeView) -> TaintPlan:
        return plan_expiry(view, settings.policy, clock())

    if dry_run:
        return TaintOutcome(decide(read_node(api, node).view), dry_run=True)
    state = read_node(api, node)
    job = state.view.record.job if state.view.record is not None else settings.policy.job
    ledger = TaintLedger(timeline, job, settings.ledger_timeout, history=settings.history)
    with ledger.locked():
        result = apply_plan(
            api, node, decide, event_namespace=settings.event_namespace, retries=settings.retries
        )
        if result.applied:
            ledger.record(result.plan, clock())
    return _outcome(result, JobBudget())


def _outcome(result: ApplyResult, budget: JobBudget) -> TaintOutcome:
    return TaintOutcome(
        result.plan,
        dry_run=False,
        applied=result.applied,
        attempts=result.attempts,
        event_name=result.event_name,
        budget=budget,
    )
