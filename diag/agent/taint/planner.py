"""Node taints with evidence: the pure planner.

The agent on a node decides about its own node only. `plan_taint` takes what the node looks like
now (its taints, conditions and diag's evidence record), the new evidence, the policy, the job's
taint budget and the time, and returns a `TaintPlan`: the full taint list the node should carry,
its `DiagUnhealthy` condition (node-problem-detector style), the annotation that records the
evidence, and the Event to post. Nothing here talks to Kubernetes: `diag/agent/taint/kube.py` applies plans.
The names and data types are in `diag/agent/taint/model.py` (and importable from here).

What taints (each an `Evidence` with its `Signal`):
- a precheck verdict `faulty` for this node;
- this node named culprit in `culprit_threshold` distinct incidents within `culprit_window`;
- a critical GPU XID (any XID except the application-caused ones in `ignore_xids`);
- uncorrected GPU ECC errors;
- the node's NIC without carrier.
What untaints: a clean precheck after the taint, `diag untaint` (`plan_untaint`), the expiry.
"""

from __future__ import annotations

from collections.abc import Sequence

from diag.agent.taint.model import (
    APPLICATION_XIDS,
    CONDITION_TYPE,
    DOMAIN,
    EVENT_BLOCKED,
    EVENT_TAINTED,
    EVENT_UNTAINTED,
    EVENT_UPDATED,
    HARDWARE_XIDS,
    MAX_EVIDENCE,
    MAX_EXPIRY,
    NO_EXECUTE,
    NO_SCHEDULE,
    RECORD_ANNOTATION,
    RECORD_MAX_CHARS,
    TAINT_KEY,
    Action,
    ClearReason,
    Condition,
    Evidence,
    Fault,
    JobBudget,
    NodeEvent,
    NodeView,
    Reason,
    Signal,
    Taint,
    TaintPlan,
    TaintPolicy,
    TaintRecord,
)

__all__ = [
    "APPLICATION_XIDS",
    "CONDITION_TYPE",
    "DOMAIN",
    "EVENT_BLOCKED",
    "EVENT_TAINTED",
    "EVENT_UNTAINTED",
    "EVENT_UPDATED",
    "HARDWARE_XIDS",
    "MAX_EVIDENCE",
    "MAX_EXPIRY",
    "NO_EXECUTE",
    "NO_SCHEDULE",
    "RECORD_ANNOTATION",
    "RECORD_MAX_CHARS",
    "TAINT_KEY",
    "Action",
    "ClearReason",
    "Condition",
    "Evidence",
    "Fault",
    "JobBudget",
    "NodeEvent",
    "NodeView",
    "Reason",
    "Signal",
    "Taint",
    "TaintPlan",
    "TaintPolicy",
    "TaintRecord",
    "faults_of",
    "plan_expiry",
    "plan_taint",
    "plan_untaint",
]


def faults_of(evidence: Sequence[Evidence], policy: TaintPolicy, now: float) -> tuple[Fault, ...]:
    """The evidence that is enough to taint, hardware first, newest first within a kind."""
    out: list[Fault] = []
    for ev in sorted(evidence, key=lambda e: -e.at):
        where = f" ({ev.detail})" if ev.detail else ""
        if ev.signal == Signal.GPU_ECC and ev.count > 0:
            gpu = f"GPU {ev.gpu}: " if ev.gpu is not None else ""
            out.append(
                Fault(Reason.GPU_ECC, True, f"{gpu}{ev.count} uncorrected ECC errors{where}", ev)
            )
        elif (
            ev.signal == Signal.GPU_XID and ev.xid is not None and ev.xid not in policy.ignore_xids
        ):
            gpu = f" on GPU {ev.gpu}" if ev.gpu is not None else ""
            hw = ev.xid in policy.hardware_xids
            out.append(Fault(Reason.GPU_XID, hw, f"XID {ev.xid}{gpu}{where}", ev))
        elif ev.signal == Signal.NIC_NO_CARRIER:
            out.append(Fault(Reason.NIC_NO_CARRIER, True, f"NIC without carrier{where}", ev))
        elif ev.signal == Signal.PRECHECK_FAULTY:
            out.append(Fault(Reason.PRECHECK_FAULTY, False, f"precheck: faulty{where}", ev))
    culprit = [
        e for e in evidence if e.signal == Signal.CULPRIT and now - e.at <= policy.culprit_window
    ]
    incidents = {e.incident_id or f"{e.at}" for e in culprit}
    if policy.culprit_threshold > 0 and len(incidents) >= policy.culprit_threshold:
        newest = max(culprit, key=lambda e: e.at)
        hours = policy.culprit_window / 3600
        out.append(
            Fault(
                Reason.REPEATED_CULPRIT,
                False,
                f"culprit of {len(incidents)} incidents in {hours:g} h "
                f"({', '.join(sorted(incidents))})",
                newest,
            )
        )
    order = list(Reason)
    out.sort(key=lambda f: (not f.hardware, order.index(f.reason)))
    return tuple(out)


def plan_taint(
    node: NodeView,
    evidence: Sequence[Evidence],
    policy: TaintPolicy,
    budget: JobBudget,
    now: float,
) -> TaintPlan:
    """The change to make to `node` given the evidence. Pure: the same input, the same plan."""
    faults = faults_of(evidence, policy, now)
    ours = node.ours
    record = node.record
    if not faults:
        cond = node.condition()
        if ours or record is not None or (cond is not None and cond.status == "True"):
            return _plan_clear_if_due(node, evidence, now)
        return TaintPlan(node.name, Action.NONE, "no evidence that taints", taints=node.taints)

    main = faults[0]
    effects = [NO_SCHEDULE]
    if policy.no_execute and any(f.hardware for f in faults):
        effects.append(NO_EXECUTE)
    message = "; ".join(f.line for f in faults)
    incident_id = main.evidence.incident_id or next(
        (f.evidence.incident_id for f in faults if f.evidence.incident_id), ""
    )
    incident_path = main.evidence.incident_path or next(
        (f.evidence.incident_path for f in faults if f.evidence.incident_path), ""
    )
    # Never "forever": the admission policy refuses a record without an expiry.
    until = now + (min(policy.expiry, MAX_EXPIRY) if policy.expiry > 0 else MAX_EXPIRY)

    if ours:
        have = {t.effect for t in ours}
        new_effects = [e for e in effects if e not in have]
        known = record.evidence if record is not None else ()
        new_lines = [f.line for f in faults if f.line not in known]
        if not new_effects and not new_lines:
            return TaintPlan(
                node.name, Action.NONE, f"already tainted ({main.reason.value})", node.taints
            )
        # The record keeps what it held (another agent's evidence among it), new lines first,
        # and the weightier reason of the two.
        reason = main.reason
        if record is not None and list(Reason).index(record.reason) < list(Reason).index(reason):
            reason = record.reason
        lines = tuple(dict.fromkeys([*(f.line for f in faults), *known]))[:MAX_EVIDENCE]
        message = "; ".join(lines)
        added = tuple(Taint(TAINT_KEY, e, reason.value) for e in new_effects)
        rec = TaintRecord(
            reason=reason,
            message=message,
            since=record.since if record is not None else now,
            until=until,
            job=record.job if record is not None and record.job else policy.job,
            incident_id=incident_id,
            incident_path=incident_path,
            effects=tuple(sorted(have | set(effects))),
            evidence=lines,
        ).bounded()
        return TaintPlan(
            node.name,
            Action.UPDATE,
            f"new evidence on a tainted node: {'; '.join(new_lines) or 'NoExecute due'}",
            taints=node.taints + added,
            added=added,
            condition=_condition(node, "True", reason.value, message, now),
            record=rec,
            event=NodeEvent(
                "Warning", EVENT_UPDATED, _event_text(message, rec), incident_id, incident_path
            ),
            faults=faults,
        )

    blocked = _budget_blocks(node.name, policy, budget, now)
    if blocked:
        text = f"{message}; not tainted: {blocked}"
        return TaintPlan(
            node.name,
            Action.BLOCKED,
            text,
            taints=node.taints,
            condition=_condition(node, "True", main.reason.value, text, now),
            event=NodeEvent("Warning", EVENT_BLOCKED, text, incident_id, incident_path),
            faults=faults,
            blocked_by=blocked.split(":")[0],
        )
    added = tuple(Taint(TAINT_KEY, e, main.reason.value) for e in effects)
    rec = TaintRecord(
        reason=main.reason,
        message=message,
        since=now,
        until=until,
        job=policy.job,
        incident_id=incident_id,
        incident_path=incident_path,
        effects=tuple(effects),
        evidence=tuple(f.line for f in faults),
    ).bounded()
    return TaintPlan(
        node.name,
        Action.TAINT,
        message,
        taints=node.taints + added,
        added=added,
        condition=_condition(node, "True", main.reason.value, message, now),
        record=rec,
        event=NodeEvent(
            "Warning", EVENT_TAINTED, _event_text(message, rec), incident_id, incident_path
        ),
        faults=faults,
    )


def plan_untaint(node: NodeView, now: float, why: str = "diag untaint") -> TaintPlan:
    """Remove diag's taints, record and condition (the node's other taints stay)."""
    return _clear(node, ClearReason.MANUAL, why, now)


def plan_expiry(node: NodeView, policy: TaintPolicy, now: float) -> TaintPlan:
    """For the expiry sweep (`diag untaint --expired`): untaint `node` when its taint expired,
    else nothing. It has no evidence, and changes nothing but diag's taint and condition.

    A record that expires never, or later than MAX_EXPIRY from now, is past the bound: no
    writer of diag's makes one (the admission policy, without a clock, cannot tell), so the
    taint goes now."""
    record = node.record
    if record is not None and (record.until is None or record.until > now + MAX_EXPIRY):
        return _clear(node, ClearReason.EXPIRED, "the taint's expiry is past the bound", now)
    plan = plan_taint(node, (), policy, JobBudget(), now)
    if plan.action != Action.UNTAINT:
        return TaintPlan(node.name, Action.NONE, plan.why, taints=node.taints)
    return plan


def _plan_clear_if_due(node: NodeView, evidence: Sequence[Evidence], now: float) -> TaintPlan:
    record = node.record
    since = record.since if record is not None else None
    clean = [
        e
        for e in evidence
        if e.signal == Signal.PRECHECK_HEALTHY and (since is None or e.at > since)
    ]
    if clean:
        newest = max(clean, key=lambda e: e.at)
        detail = f" ({newest.detail})" if newest.detail else ""
        return _clear(node, ClearReason.PRECHECK_CLEAN, f"clean precheck{detail}", now)
    if record is not None and record.until is not None and now >= record.until:
        return _clear(node, ClearReason.EXPIRED, "the taint expired", now)
    return TaintPlan(node.name, Action.NONE, "tainted, nothing clears it yet", taints=node.taints)


def _clear(node: NodeView, reason: ClearReason, why: str, now: float) -> TaintPlan:
    removed = node.ours
    cond = node.condition()
    if not removed and node.record is None and (cond is None or cond.status != "True"):
        return TaintPlan(node.name, Action.NONE, "not tainted by diag", taints=node.taints)
    was = node.record.reason.value if node.record is not None else "unknown"
    message = f"{why}; was {was}"
    return TaintPlan(
        node.name,
        Action.UNTAINT,
        message,
        taints=tuple(t for t in node.taints if t.key != TAINT_KEY),
        removed=removed,
        condition=_condition(node, "False", reason.value, message, now),
        clear_record=node.record is not None,
        event=NodeEvent(
            "Normal",
            EVENT_UNTAINTED,
            message,
            node.record.incident_id if node.record is not None else "",
            node.record.incident_path if node.record is not None else "",
        ),
    )


def _budget_blocks(name: str, policy: TaintPolicy, budget: JobBudget, now: float) -> str:
    others = [n for n in budget.tainted_nodes if n != name]
    if len(others) >= policy.job_cap:
        return (
            f"job-cap: job {policy.job or '?'} already holds {len(others)} node(s) tainted "
            f"({', '.join(sorted(others))}), the cap is {policy.job_cap}"
        )
    recent = [t for t in budget.recent_taints if now - t < policy.rate_window]
    if len(recent) >= policy.rate_count:
        return (
            f"rate-limit: job {policy.job or '?'} tainted {len(recent)} node(s) in the last "
            f"{policy.rate_window:g} s, the limit is {policy.rate_count}"
        )
    return ""


def _condition(node: NodeView, status: str, reason: str, message: str, now: float) -> Condition:
    old = node.condition()
    since = old.last_transition if old is not None and old.status == status else now
    return Condition(CONDITION_TYPE, status, reason, message[:1024], since, now)


def _event_text(message: str, rec: TaintRecord) -> str:
    parts = [f"{rec.reason.value}: {message}"]
    if rec.incident_id:
        parts.append(f"incident {rec.incident_id}")
    if rec.incident_path:
        parts.append(f"evidence {rec.incident_path}")
    return "; ".join(parts)
