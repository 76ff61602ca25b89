"""Node taints with evidence: the documented names and the data the planner works on.

The taint key, the condition type, the annotation and the Event reasons (docs: operator/taints.md),
the evidence (`Evidence`, one `Signal` each), what the planner sees of a node (`NodeView`, with
diag's `TaintRecord`), its policy and the job's budget, and the `TaintPlan` it returns. The
planner itself is `diag/agent/taint/planner.py`; `diag/agent/taint/kube.py` applies plans.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# The documented names (docs: operator/taints.md). Keep in step with that page and the policy.
DOMAIN = "diag.dev"
TAINT_KEY = f"{DOMAIN}/unhealthy"
CONDITION_TYPE = "DiagUnhealthy"
RECORD_ANNOTATION = f"{DOMAIN}/taint-record"
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
MAX_EVIDENCE = 20  # lines of evidence a record keeps
# The admission policy (deploy/k8s/policy) refuses a longer record: `bounded` keeps ours within.
RECORD_MAX_CHARS = 8192
# The longest a taint lasts without new evidence: the expiry sweep removes a taint whose record
# expires later than this from now, or never.
MAX_EXPIRY = 7 * 24 * 3600.0

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

    def bounded(self, limit: int = RECORD_MAX_CHARS) -> TaintRecord:
        """This record, its text cut until its JSON fits `limit` characters: evidence lines
        (detail from the node's logs and reports) and paths have no length of their own."""
        if len(self.to_json()) <= limit:
            return self
        rec = replace(
            self,
            message=_cut(self.message, 1024),
            job=_cut(self.job, 253),
            incident_id=_cut(self.incident_id, 256),
            incident_path=_cut(self.incident_path, 512),
            evidence=tuple(_cut(line, 256) for line in self.evidence),
        )
        while len(rec.to_json()) > limit and rec.evidence:
            rec = replace(rec, evidence=rec.evidence[:-1])  # the oldest lines go first
        if len(rec.to_json()) > limit:
            # Even the fields alone are too long (escaped non-ASCII text takes 6 characters
            # per character): keep what names the fault.
            rec = replace(
                rec, message=_cut(rec.message, 128), incident_path=_cut(rec.incident_path, 128)
            )
        return rec

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
    # Seconds a taint lasts without new evidence; 0, or more than MAX_EXPIRY: MAX_EXPIRY.
    expiry: float = 24 * 3600.0
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


def _cut(text: str, size: int) -> str:
    return text if len(text) <= size else text[: size - 3] + "..."


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _taint_text(t: Taint) -> str:
    return f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}"
