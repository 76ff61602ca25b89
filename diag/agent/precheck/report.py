"""`PrecheckReport`: the verdict as plain data, its JSON form, and the exit code it implies.

The JSON written by `--report` is this dataclass, field for field; `from_dict` parses it back, so
the coordinator can ship it to every node and later consumers (node tainting) can read it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from diag.agent.node.linkstate import NicState
from diag.agent.precheck.classify import Assessment, Observations, classify
from diag.agent.precheck.grading import Thresholds, grade_pairs
from diag.agent.precheck.measurements import (
    MAX_ITEMS,
    MAX_NODES,
    Check,
    ComputeResult,
    CopyResult,
    DeviceHealth,
    Finding,
    LocalEvidence,
    Severity,
    local_evidence,
    nic_state,
)
from diag.formats import exitcodes
from diag.formats.checkedjson import NAME, TEXT, Fields
from diag.formats.untrusted import MIB, UntrustedInput, read_json

REPORT_VERSION = 1
# What `--report` writes: 12 KiB a node of 8 GPUs in a real run, 190 MiB for 16,000 nodes.
MAX_REPORT_BYTES = 512 * MIB


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
    def from_dict(cls, d: object, source: str = "precheck report") -> PrecheckReport:
        """Checked against our types and bounds: raises UntrustedInput naming `source` and the
        field (a report is read back from a file or from the coordinator's store)."""
        f = Fields(d, source)
        version = f.int("version", 0, 1 << 31, 0)
        if version != REPORT_VERSION:
            raise UntrustedInput(
                source, f"precheck report version {version}, expected {REPORT_VERSION}"
            )
        nnodes = f.int("nnodes", 0, MAX_NODES)
        node_hi = max(0, nnodes - 1)  # node ranks are bounded by the job's node count
        rounds = []
        for i, r in enumerate(f.list("rounds", MAX_ITEMS)):
            pairs = Fields({"r": r}, source, f"rounds[{i}]").list("r", MAX_NODES)
            rounds.append(tuple(_pair(p, source, f"rounds[{i}]", node_hi) for p in pairs))
        return cls(
            job=f.str("job"),
            nnodes=nnodes,
            reported_by=f.int("reported_by", 0, node_hi),
            outcome=f.enum("outcome", Outcome),
            faulty=f.ints("faulty", 0, node_hi, MAX_NODES),
            stragglers=f.ints("stragglers", 0, node_hi, MAX_NODES),
            suspects=f.ints("suspects", 0, node_hi, MAX_NODES),
            error=f.opt_str("error", TEXT),
            started_at=f.float("started_at", 0.0),
            wall_seconds=f.float("wall_seconds", 0.0),
            median_busbw_bytes_per_s=f.opt_float("median_busbw_bytes_per_s", 0.0),
            median_compute_flops=f.opt_float("median_compute_flops", 0.0),
            median_copy_bytes_per_s=f.opt_float("median_copy_bytes_per_s", 0.0),
            rounds=tuple(rounds),
            nodes=tuple(_node(n, node_hi) for n in f.objs("nodes", MAX_NODES)),
            settings=_settings(f.opt_obj("settings")),
            version=version,
        )


def read_report(path: Path) -> PrecheckReport:
    """The report file at `path` (a regular file under the cap, not through a symlink),
    checked; raises UntrustedInput naming it."""
    return PrecheckReport.from_dict(read_json(path, max_bytes=MAX_REPORT_BYTES), str(path))


def _pair(p: object, source: str, where: str, hi: int) -> tuple[int, int]:
    if (
        not isinstance(p, list)
        or len(p) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= hi for x in p)
    ):
        raise UntrustedInput(source, f"{where} holds a pair that is not two node ranks")
    return p[0], p[1]


def _settings(f: Fields | None) -> dict[str, str | float | int | None]:
    if f is None:
        return {}
    if len(f.d) > MAX_ITEMS:
        raise UntrustedInput(f.source, f"{f.where} has over {MAX_ITEMS} settings")
    out: dict[str, str | float | int | None] = {}
    for k, v in f.d.items():
        if len(k) > NAME:
            raise f.fail(k[:40], "is not a setting's name")
        if isinstance(v, str):
            out[k] = f.str(k, max_len=TEXT)
        elif isinstance(v, bool) or v is None:
            out[k] = v
        elif isinstance(v, int):
            out[k] = f.int(k, -(2**63), 2**63)
        else:
            out[k] = f.float(k)
    return out


def _link(f: Fields, hi: int) -> LinkReport:
    return LinkReport(
        round=f.int("round", 0, MAX_ITEMS),
        peer=f.int("peer", 0, hi),
        busbw_bytes_per_s=f.opt_float("busbw_bytes_per_s", 0.0),
        grade=f.str("grade"),
        error=f.opt_str("error", TEXT),
    )


def _node(f: Fields, hi: int) -> NodeReport:
    local = local_evidence(Fields({**f.d, "host": ""}, f.source, f.where))
    nic = f.opt_obj("nic")
    return NodeReport(
        node=f.int("node", 0, hi),
        status=f.enum("status", Severity),
        reason=f.str("reason", "", TEXT),
        findings=tuple(
            Finding(
                x.enum("check", Check), x.enum("severity", Severity), x.str("message", "", TEXT)
            )
            for x in f.objs("findings", MAX_ITEMS)
        ),
        host=f.str("host", ""),
        addr=f.str("addr", ""),
        busbw_bytes_per_s=f.opt_float("busbw_bytes_per_s", 0.0),
        median_busbw_bytes_per_s=f.opt_float("median_busbw_bytes_per_s", 0.0),
        compute_flops=f.opt_float("compute_flops", 0.0),
        median_compute_flops=f.opt_float("median_compute_flops", 0.0),
        copy_bytes_per_s=f.opt_float("copy_bytes_per_s", 0.0),
        median_copy_bytes_per_s=f.opt_float("median_copy_bytes_per_s", 0.0),
        links=tuple(_link(x, hi) for x in f.objs("links", MAX_ITEMS)),
        compute=local.compute,
        copies=local.copies,
        devices=local.devices,
        nic=nic_state(nic) if nic is not None else None,
        notes=f.strs("notes", MAX_ITEMS),
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
