"""`PrecheckReport`: the verdict as plain data, its JSON form, and the exit code it implies.

The JSON written by `--report` is this dataclass, field for field; `from_dict` parses it back, so
the coordinator can ship it to every node and later consumers (node tainting) can read it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from diag.agent import exitcodes
from diag.agent.precheck.classify import Assessment, Observations, classify
from diag.agent.precheck.evidence import (
    Check,
    ComputeResult,
    CopyResult,
    DeviceHealth,
    Finding,
    LocalEvidence,
    NicState,
    Severity,
)
from diag.agent.precheck.grading import Thresholds, grade_pairs

REPORT_VERSION = 1


class Outcome(enum.StrEnum):
    HEALTHY = "healthy"  # every node passed
    FAULTY = "faulty"  # faulty, straggling or suspect nodes were found
    ERROR = "error"  # the check could not run to a conclusion

    @property
    def exit_code(self) -> int:
        return {
            Outcome.HEALTHY: exitcodes.OK,
            Outcome.FAULTY: exitcodes.PRECHECK_FAULTY,
            Outcome.ERROR: exitcodes.PRECHECK_ERROR,
        }[self]


@dataclass(frozen=True)
class LinkReport:
    """One inter-node pair as seen from one node."""

    round: int
    peer: int
    busbw_bytes_per_s: float | None
    grade: str  # good / slow / failed
    error: str | None = None


@dataclass(frozen=True)
class NodeReport:
    node: int
    status: Severity
    reason: str  # the bad findings joined; empty when healthy
    findings: tuple[Finding, ...] = ()
    host: str = ""
    addr: str = ""
    busbw_bytes_per_s: float | None = None
    median_busbw_bytes_per_s: float | None = None
    compute_flops: float | None = None
    median_compute_flops: float | None = None
    copy_bytes_per_s: float | None = None
    median_copy_bytes_per_s: float | None = None
    links: tuple[LinkReport, ...] = ()
    compute: tuple[ComputeResult, ...] = ()
    copies: tuple[CopyResult, ...] = ()
    devices: tuple[DeviceHealth, ...] = ()
    nic: NicState | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrecheckReport:
    job: str
    nnodes: int
    reported_by: int  # the node that wrote this copy of the report
    outcome: Outcome
    faulty: tuple[int, ...] = ()
    stragglers: tuple[int, ...] = ()
    suspects: tuple[int, ...] = ()
    error: str | None = None
    started_at: float = 0.0  # unix time
    wall_seconds: float = 0.0
    median_busbw_bytes_per_s: float | None = None
    median_compute_flops: float | None = None
    median_copy_bytes_per_s: float | None = None
    rounds: tuple[tuple[tuple[int, int], ...], ...] = ()
    nodes: tuple[NodeReport, ...] = ()
    settings: Mapping[str, str | float | int | None] = field(default_factory=dict)
    version: int = REPORT_VERSION

    @property
    def exit_code(self) -> int:
        return self.outcome.exit_code

    def node(self, rank: int) -> NodeReport | None:
        return next((n for n in self.nodes if n.node == rank), None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["settings"] = dict(self.settings)
        return d

    def with_reporter(self, rank: int, wall_seconds: float | None = None) -> PrecheckReport:
        if wall_seconds is None:
            return replace(self, reported_by=rank)
        return replace(self, reported_by=rank, wall_seconds=wall_seconds)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrecheckReport:
        version = int(d.get("version", 0))
        if version != REPORT_VERSION:
            raise ValueError(f"precheck report version {version}, expected {REPORT_VERSION}")
        return cls(
            job=str(d["job"]),
            nnodes=int(d["nnodes"]),
            reported_by=int(d["reported_by"]),
            outcome=Outcome(d["outcome"]),
            faulty=tuple(int(n) for n in d.get("faulty", ())),
            stragglers=tuple(int(n) for n in d.get("stragglers", ())),
            suspects=tuple(int(n) for n in d.get("suspects", ())),
            error=d.get("error"),
            started_at=float(d.get("started_at", 0.0)),
            wall_seconds=float(d.get("wall_seconds", 0.0)),
            median_busbw_bytes_per_s=d.get("median_busbw_bytes_per_s"),
            median_compute_flops=d.get("median_compute_flops"),
            median_copy_bytes_per_s=d.get("median_copy_bytes_per_s"),
            rounds=tuple(tuple((int(a), int(b)) for a, b in r) for r in d.get("rounds", ())),
            nodes=tuple(_node_from_dict(n) for n in d.get("nodes", ())),
            settings=dict(d.get("settings", {})),
            version=version,
        )


def _node_from_dict(d: Mapping[str, Any]) -> NodeReport:
    local = LocalEvidence.from_dict(
        {
            "node": d["node"],
            "devices": d.get("devices", ()),
            "compute": d.get("compute", ()),
            "copies": d.get("copies", ()),
            "nic": d.get("nic"),
        }
    )
    return NodeReport(
        node=int(d["node"]),
        status=Severity(d["status"]),
        reason=str(d.get("reason", "")),
        findings=tuple(
            Finding(Check(f["check"]), Severity(f["severity"]), str(f["message"]))
            for f in d.get("findings", ())
        ),
        host=str(d.get("host", "")),
        addr=str(d.get("addr", "")),
        busbw_bytes_per_s=d.get("busbw_bytes_per_s"),
        median_busbw_bytes_per_s=d.get("median_busbw_bytes_per_s"),
        compute_flops=d.get("compute_flops"),
        median_compute_flops=d.get("median_compute_flops"),
        copy_bytes_per_s=d.get("copy_bytes_per_s"),
        median_copy_bytes_per_s=d.get("median_copy_bytes_per_s"),
        links=tuple(LinkReport(**x) for x in d.get("links", ())),
        compute=local.compute,
        copies=local.copies,
        devices=local.devices,
        nic=local.nic,
        notes=tuple(d.get("notes", ())),
    )


def build_report(
    *,
    job: str,
    obs: Observations,
    assessment: Assessment,
    th: Thresholds,
    rounds: Sequence[Sequence[tuple[int, int]]],
    addrs: Mapping[int, str],
    reported_by: int,
    started_at: float,
    wall_seconds: float,
    settings: Mapping[str, str | float | int | None],
) -> PrecheckReport:
    eligible = [n for n in obs.joined if n not in obs.lost]
    grading = grade_pairs(obs.pairs, eligible, th)
    nodes = []
    for v in assessment.verdicts:
        ev = obs.local.get(v.node)
        links = tuple(
            LinkReport(
                round=p.round,
                peer=p.other(v.node),
                busbw_bytes_per_s=p.busbw,
                grade=grading.grades[p].value if p in grading.grades else "failed",
                error=p.error,
            )
            for p in obs.pairs
            if p.has(v.node)
        )
        nodes.append(
            NodeReport(
                node=v.node,
                status=v.status,
                reason=v.reason,
                findings=v.findings,
                host=ev.host if ev else "",
                addr=addrs.get(v.node, ""),
                busbw_bytes_per_s=v.busbw,
                median_busbw_bytes_per_s=assessment.median_busbw,
                compute_flops=v.compute_flops,
                median_compute_flops=assessment.median_compute,
                copy_bytes_per_s=v.copy_bw,
                median_copy_bytes_per_s=assessment.median_copy,
                links=links,
                compute=ev.compute if ev else (),
                copies=ev.copies if ev else (),
                devices=ev.devices if ev else (),
                nic=ev.nic if ev else None,
                notes=v.notes,
            )
        )
    faulty = tuple(assessment.nodes_with(Severity.FAULTY))
    stragglers = tuple(assessment.nodes_with(Severity.STRAGGLER))
    suspects = tuple(assessment.nodes_with(Severity.SUSPECT))
    if assessment.error:
        outcome = Outcome.ERROR
    elif faulty or stragglers or suspects:
        outcome = Outcome.FAULTY
    else:
        outcome = Outcome.HEALTHY
    return PrecheckReport(
        job=job,
        nnodes=obs.nnodes,
        reported_by=reported_by,
        outcome=outcome,
        faulty=faulty,
        stragglers=stragglers,
        suspects=suspects,
        error=assessment.error,
        started_at=started_at,
        wall_seconds=wall_seconds,
        median_busbw_bytes_per_s=assessment.median_busbw,
        median_compute_flops=assessment.median_compute,
        median_copy_bytes_per_s=assessment.median_copy,
        rounds=tuple(tuple(r) for r in rounds),
        nodes=tuple(nodes),
        settings=dict(settings),
    )


def error_report(
    *,
    job: str,
    nnodes: int,
    node: int,
    error: str,
    local: LocalEvidence | None,
    started_at: float,
    wall_seconds: float,
    settings: Mapping[str, str | float | int | None],
    th: Thresholds,
) -> PrecheckReport:
    """What a node reports when it could not take part (no rendezvous, lost the coordinator).

    Its own evidence still counts: a node that sees no carrier on its own NIC names itself."""
    obs = Observations(
        nnodes=nnodes,
        joined=frozenset(range(nnodes)),
        local={node: local} if local else {},
    )
    assessment = classify(obs, th)
    mine = next(v for v in assessment.verdicts if v.node == node)
    own_fault = mine.status is Severity.FAULTY
    nodes = tuple(
        NodeReport(
            node=v.node,
            status=v.status,
            reason=v.reason,
            findings=v.findings,
            host=local.host if local and v.node == node else "",
            nic=local.nic if local and v.node == node else None,
            notes=v.notes,
        )
        for v in assessment.verdicts
        if v.node == node
    )
    return PrecheckReport(
        job=job,
        nnodes=nnodes,
        reported_by=node,
        outcome=Outcome.FAULTY if own_fault else Outcome.ERROR,
        faulty=(node,) if own_fault else (),
        error=error,
        started_at=started_at,
        wall_seconds=wall_seconds,
        nodes=nodes,
        settings=dict(settings),
    )
