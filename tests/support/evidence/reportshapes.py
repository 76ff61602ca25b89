"""Real shapes of the files the job verdict and the precheck write, for the trust tests and
the fuzz targets: node views as `view_document` writes them, reports, verdicts, precheck
reports and their metrics textfile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.job.decisions import NodeReport, Where
from diag.agent.job.nodeview import view_document
from diag.agent.node.linkstate import NicState
from diag.agent.precheck.classify import Observations, classify
from diag.agent.precheck.grading import Thresholds
from diag.agent.precheck.measurements import (
    ComputeResult,
    CopyResult,
    DeviceHealth,
    LocalEvidence,
    PairResult,
)
from diag.agent.precheck.report import PrecheckReport, build_report
from diag.formats.records import OpCode, OpState

PER_NODE = 8
JOB = "job"


def node_view(node: int, nodes: int, now: float = 100.0, wall: float | None = None) -> dict:
    """Node `node`'s view: its ranks wait in all-reduce #42 of the world group, but rank 7 (on
    node 0), which finished #41 and never entered #42."""
    ranks = []
    for local in range(PER_NODE):
        r = node * PER_NODE + local
        done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 1 << 20, now - 12, now - 11.9)
        stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 1 << 20, now - 10)
        behind = r == 7
        ranks.append(RankSnapshot(
            rank=r, local_rank=local, pid=1000 + local, node=f"node-{node}",
            liveness=Liveness.RUNNING, started_at=0.0, last_activity=now - (11.9 if behind else 10),
            step=7, pending=() if behind else (stuck,), last_ops={"0": done if behind else stuck},
        ))  # fmt: skip
    obs = Observation(
        now=now,
        ranks=tuple(ranks),
        groups={"0": tuple(range(nodes * PER_NODE))},
        world_size=nodes * PER_NODE,
        job=JOB,
    )
    return view_document(obs, f"node-{node}", time.time() if wall is None else wall)


def node_report(timeline: Path, node: int, nodes: int, culprit: int | None = None) -> NodeReport:
    where = Where.LOCAL if culprit is not None and culprit // PER_NODE == node else Where.REMOTE
    return NodeReport(
        node=f"node-{node}",
        culprit=culprit,
        where=where,
        evidence=str(timeline / f"20261125-000000-hang-node-{node}@job-a0-hang"),
        kind="hang",
        summary="hang: all-reduce #42 of group 0",
        wall=time.time(),
        view=node_view(node, nodes),
        first_sign_wall=time.time(),
    )


def precheck_report(nodes: int = 4) -> PrecheckReport:
    th = Thresholds()
    local = {
        n: LocalEvidence(
            node=n,
            host=f"host-{n}",
            accelerator="cuda",
            devices=tuple(DeviceHealth(i, "GPU", 0.01, 0, (), False, 40.0) for i in range(2)),
            compute=tuple(ComputeResult(f"cuda:{i}", 7e14, 8192, "bfloat16") for i in range(2)),
            copies=(CopyResult(0, 1, 3e11), CopyResult(1, 0, 3e11)),
            nic=NicState("eth0", f"10.0.0.{n + 1}", "up", True, 400000),
            notes=("a note",),
        )
        for n in range(nodes)
    }
    pairs = tuple(PairResult(1, a, a + 1, 4e10) for a in range(0, nodes - 1, 2))
    obs = Observations(nodes, frozenset(range(nodes)), local=local, pairs=pairs, rdzv_timeout_s=30)
    return build_report(
        job="llama",
        obs=obs,
        assessment=classify(obs, th),
        th=th,
        rounds=[[(p.a, p.b) for p in pairs]],
        addrs={n: f"10.0.0.{n + 1}" for n in range(nodes)},
        reported_by=1,
        started_at=1_700_000_000.0,
        wall_seconds=4.2,
        settings={"straggler_ratio": 0.5, "iface": "eth0", "none": None},
    )


def as_json_doc(report: NodeReport) -> dict[str, Any]:
    from dataclasses import asdict

    return {**asdict(report), "where": report.where.value}
