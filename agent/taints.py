"""Node taints with evidence: the pure planner.

The agent on a node decides about its own node only. `plan_taint` takes what the node looks like
now (its taints, conditions and diag's evidence record), the new evidence, the policy, the job's
taint budget and the time, and returns a `TaintPlan`: the full taint list the node should carry,
its `DiagUnhealthy` condition (node-problem-detector style), the annotation that records the
evidence, and the Event to post. Nothing here talks to Kubernetes: `agent/kube.py` applies plans.

What taints (each an `Evidence` with its `Signal`):
- a precheck verdict `faulty` for this node;
- this node named culprit in `culprit_threshold` distinct incidents within `culprit_window`;
- a critical GPU XID (any XID except the application-caused ones in `ignore_xids`);
- uncorrected GPU ECC errors;
- the node's NIC without carrier.
What untaints: a clean precheck after the taint, `diag untaint` (`plan_untaint`), the expiry.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# The documented names (README "Node taints"). Keep in step with the README and the policy.
DOMAIN = "diag.dev"
TAINT_KEY = f"{DOMAIN}/unhealthy"
CONDITION_TYPE = "DiagUnhealthy"
RECORD_ANNOTATION = f"{DOMAIN}/taint-record"
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
MAX_EVIDENCE = 20  # lines of evidence a record keeps

# XIDs raised by the application's own faults (illegal access, page faults, channel resets,
# preemption cleanup, video decoder): a bug in the job, not in the node.
APPLICATION_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68)
# XIDs that mean the hardware itself failed (double-bit ECC, row-remap failure, NVLink, fallen
# off the bus, contained/uncontained ECC, GSP/firmware errors): these may evict with NoExecute.
HARDWARE_XIDS: tuple[int, ...] = (48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120)


class Signal(enum.StrEnum):
    PRECHECK_FAULTY = "precheck-faulty"
    PRECHECK_HEALTHY = "precheck-healthy"  # a clean precheck: clears a taint set before it
    CULPRIT = "culprit"  # this node was named culprit of one incident
    GPU_XID = "gpu-xid"
    GPU_ECC = "gpu-ecc"  # uncorrected ECC errors
    NIC_NO_CARRIER = "nic-no-carrier"


class Reason(enum.StrEnum):
    """Why a node is tainted: the taint's value, the condition's and the Event's reason."""

    GPU_ECC = "GpuEccUncorrected"
    GPU_XID = "GpuXidCritical"
    NIC_NO_CARRIER = "NicNoCarrier"
    PRECHECK_FAULTY = "PrecheckFaulty"
    REPEATED_CULPRIT = "RepeatedCulprit"


class ClearReason(enum.StrEnum):
    PRECHECK_CLEAN = "PrecheckClean"
    MANUAL = "ManualUntaint"
    EXPIRED = "Expired"


class Action(enum.StrEnum):
    NONE = "none"  # nothing to change
    TAINT = "taint"  # add the taint, the condition, the record, an Event
    UPDATE = "update"  # already tainted: new evidence (a new incident, NoExecute now due)
    UNTAINT = "untaint"
    BLOCKED = "blocked"  # would taint, but the job's cap or rate limit holds: condition only


# Event reasons (the Event's `reason` field).
EVENT_TAINTED = "DiagTainted"
EVENT_UPDATED = "DiagTaintUpdated"
EVENT_UNTAINTED = "DiagUntainted"
EVENT_BLOCKED = "DiagTaintBlocked"


@dataclass(frozen=True)
class Evidence:
    signal: Signal
    at: float  # unix time the evidence was observed
    detail: str = ""  # one line for people: "XID 79 on GPU 3", "no carrier on eth0"
    incident_id: str = ""
    incident_path: str = ""  # the incident directory (or precheck report) holding the proof
    gpu: int | None = None
    xid: int | None = None
    count: int = 0  # ECC error count


@dataclass(frozen=True)
class Taint:
    key: str
    effect: str
    value: str = ""
    time_added: str | None = None  # as the API server reports it; kept unchanged

    def same(self, other: Taint) -> bool:
        """Kubernetes identifies a taint by key and effect."""
        return (self.key, self.effect) == (other.key, other.effect)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" / "False" / "Unknown"
    reason: str = ""
    message: str = ""
    last_transition: float = 0.0  # unix time
    last_heartbeat: float = 0.0


@dataclass(frozen=True)
class TaintRecord:
    """The evidence behind diag's taint, kept on the node as the `RECORD_ANNOTATION` JSON."""

    reason: Reason
    message: str
    since: float
    until: float | None  # expiry (unix time); None: only a clean precheck or `diag untaint`
    job: str = ""
    incident_id: str = ""
    incident_path: str = ""
    effects: tuple[str, ...] = (NO_SCHEDULE,)
    evidence: tuple[str, ...] = ()  # one line per piece of evidence

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TaintRecord:
        """Raises ValueError on a record that is not ours or is damaged."""
        try:
            d = json.loads(text)
            return cls(
                reason=Reason(d["reason"]),
                message=str(d["message"]),
                since=float(d["since"]),
                until=None if d.get("until") is None else float(d["until"]),
                job=str(d.get("job", "")),
                incident_id=str(d.get("incident_id", "")),
                incident_path=str(d.get("incident_path", "")),
                effects=tuple(str(e) for e in d.get("effects", (NO_SCHEDULE,))),
                evidence=tuple(str(e) for e in d.get("evidence", ())),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"unreadable {RECORD_ANNOTATION} annotation: {e}") from e


@dataclass(frozen=True)
class NodeView:
    """What the planner needs of a node, as read from the API server."""

    name: str
    taints: tuple[Taint, ...] = ()
    conditions: tuple[Condition, ...] = ()
    record: TaintRecord | None = None

    @property
    def ours(self) -> tuple[Taint, ...]:
        return tuple(t for t in self.taints if t.key == TAINT_KEY)

    def condition(self) -> Condition | None:
        return next((c for c in self.conditions if c.type == CONDITION_TYPE), None)


@dataclass(frozen=True)
class TaintPolicy:
    culprit_threshold: int = 3  # incidents naming this node culprit ...
    culprit_window: float = 24 * 3600.0  # ... within this many seconds
    ignore_xids: tuple[int, ...] = APPLICATION_XIDS
    hardware_xids: tuple[int, ...] = HARDWARE_XIDS
    no_execute: bool = False  # also NoExecute, for confirmed hardware faults only
    expiry: float = 24 * 3600.0  # seconds a taint lasts without new evidence; 0: no expiry
    job_cap: int = 2  # nodes one job may have tainted at once
    rate_count: int = 1  # new taints per job ...
    rate_window: float = 600.0  # ... per this many seconds
    job: str = ""


@dataclass(frozen=True)
class JobBudget:
    """The job's taints so far (from the ledger in the shared timeline volume)."""

    tainted_nodes: tuple[str, ...] = ()  # nodes the job holds tainted now
    recent_taints: tuple[float, ...] = ()  # times the job tainted a node


@dataclass(frozen=True)
class NodeEvent:
    type: str  # "Warning" / "Normal"
    reason: str
    message: str
    incident_id: str = ""
    incident_path: str = ""


@dataclass(frozen=True)
class Fault:
    """One piece of evidence that is enough to taint."""

    reason: Reason
    hardware: bool
    line: str
    evidence: Evidence


@dataclass(frozen=True)
class TaintPlan:
    node: str
    action: Action
    why: str
    taints: tuple[Taint, ...] = ()  # the node's full taint list after the plan
    added: tuple[Taint, ...] = ()
    removed: tuple[Taint, ...] = ()
    condition: Condition | None = None  # diag's condition after the plan (None: unchanged)
    record: TaintRecord | None = None  # the annotation after the plan
    clear_record: bool = False  # remove the annotation
    event: NodeEvent | None = None
    faults: tuple[Fault, ...] = field(default=(), compare=False)
    blocked_by: str = ""  # "job-cap" / "rate-limit"

    @property
    def changes_node(self) -> bool:
        return self.action in (Action.TAINT, Action.UPDATE, Action.UNTAINT, Action.BLOCKED)

    @property
    def claims_budget(self) -> bool:
        """Whether applying it takes one of the job's taint slots."""
        return self.action == Action.TAINT

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("faults")
        return d

    def describe(self) -> str:
        """Readable plan, for `diag taint --dry-run` and the log."""
        lines = [f"node {self.node}: {self.action.value}: {self.why}"]
        lines += [f"  + taint {_taint_text(t)}" for t in self.added]
        lines += [f"  - taint {_taint_text(t)}" for t in self.removed]
        if self.condition is not None:
            c = self.condition
            lines.append(f"  condition {c.type}={c.status} ({c.reason}): {c.message}")
        if self.record is not None:
            until = "never" if self.record.until is None else _utc(self.record.until)
            lines.append(f"  record: since {_utc(self.record.since)}, expires {until}")
        if self.clear_record:
            lines.append(f"  - annotation {RECORD_ANNOTATION}")
        if self.event is not None:
            lines.append(f"  event {self.event.type} {self.event.reason}: {self.event.message}")
        return "\n".join(lines)


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _taint_text(t: Taint) -> str:
    return f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}"


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
    until = now + policy.expiry if policy.expiry > 0 else None

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
        )
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
    )
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
