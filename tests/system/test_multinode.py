"""Two "nodes" on one machine: a 4-rank job under two torchrun agents (2 ranks each), each node
with its own run directory and its own `diag agent`, sharing the timeline as a cluster shares a
volume. Rank 3, on node-b, hangs. Node-b's agent names it first-hand; node-a's says its ranks wait
for ranks on other nodes and leaves the name to the job verdict. Both incident directories carry
the same incident id and `diag merge` merges them; the job gets one job verdict (rank 3 on node-b)
and `diag taint --dry-run` plans a taint for node-b only. A death on node-a that gloo turns into
deaths on node-b is one incident too."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from children import stop_jobs_and_agents
from jobrun import free_port
from kubecluster import cluster
from netlab import netns_unavailable

from diag.viewer.merge import merge_incident

# Two nodes as two process groups on one network. Where network namespaces work, the same
# scenarios run with each node in its own namespace (test_multinode_netns.py, default tier) and
# these are the long tier; elsewhere these are the default tier's multi-node tests.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    *([] if netns_unavailable() else [pytest.mark.long]),
]


def _taint_plans(tmp_path: Path, timeline: Path, culprit: str) -> dict[str, str]:
    """`diag taint --dry-run` on each node, as its agent would run it."""
    if os.environ.get("KUBECONFIG"):
        pytest.skip("the taint plan part runs against the in-memory API only (fixed node names)")
    out = {}
    (tmp_path / "kube").mkdir()
    with cluster(tmp_path / "kube") as kube:
        kube.prefix = "node"  # the nodes of this test are node-a and node-b
        for short in ("a", "b"):
            name = kube.create_node(short)
            r = subprocess.run(
                [sys.executable, "-m", "diag.cli.main", "taint", "--node", name, "--job", "mn",
                 "--timeline", str(timeline), "--no-gpu-probe", "--dry-run",
                 "--taint-culprit-threshold", "1"],
                env={**os.environ, "KUBECONFIG": kube.kubeconfig}, capture_output=True,
                text=True, timeout=120,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            out[name] = r.stdout
    assert culprit in out
    return out


@contextmanager
def two_nodes(
    tmp_path: Path, fault: str, fault_rank: int
) -> Iterator[tuple[list[subprocess.Popen[bytes]], list[subprocess.Popen[bytes]]]]:
    """Agents and launchers of two "nodes" on this machine; `fault` on rank `fault_rank` at
    step 4. Yields (agents, launchers)."""
    timeline, port = tmp_path / "timeline", free_port()
    agents: list[subprocess.Popen[bytes]] = []
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        for node_rank, node in enumerate(("node-a", "node-b")):
            run = tmp_path / f"run-{node}"
            env = dict(
                os.environ,
                DIAG_RUN_DIR=str(run),
                DIAG_JOB="mn",
                DIAG_NODE=node,
                OMP_NUM_THREADS="1",
            )
            log = open(tmp_path / f"agent-{node}.log", "wb")  # noqa: SIM115
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run),
                 "--timeline", str(timeline), "--job", "mn", "--node", node, "--hang-timeout",
                 "20", "--hang-floor", "3", "--warmup-timeout", "60", "--on-hang", "none",
                 "--until", "incident", "--interval", "0.25", "-v"],
                env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
            jobs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                 str(node_rank), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "-m", "diag.trainer.demo_job", "--fault", fault,
                 "--fault-rank", str(fault_rank), "--fault-step", "4", "--steps", "40"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))  # fmt: skip
        yield agents, jobs
    finally:
        stop_jobs_and_agents(jobs, agents)


def _verdicts(timeline: Path) -> dict[str, tuple[Path, dict]]:
    out = {}
    for d in timeline.iterdir():
        if (d / "verdict.json").exists():
            v = json.loads((d / "verdict.json").read_text())
            out[v["node"]] = (d, v)
    return out


def test_both_nodes_name_the_hung_rank_on_node_b(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline"
    with two_nodes(tmp_path, "hang", 3) as (agents, _):
        for a in agents:
            a.wait(timeout=180)
        verdicts = _verdicts(timeline)
        logs = {n: (tmp_path / f"agent-{n}.log").read_text()[-2000:] for n in ("node-a", "node-b")}
        assert set(verdicts) == {"node-a", "node-b"}, logs
        b, a = verdicts["node-b"][1], verdicts["node-a"][1]
        assert b["culprit"] == 3, b["summary"]
        # Node-a cannot see node-b's ranks: it says so instead of guessing.
        assert a["culprit"] is None, a["summary"]
        assert (
            "ranks on other nodes (ranks 2, 3): the job verdict names the culprit" in (a["summary"])
        )
        assert verdicts["node-a"][1]["incident_id"] == verdicts["node-b"][1]["incident_id"]
        merged = merge_incident(timeline)
        assert len(merged.sources) == 2 and merged.world_size == 4
        assert merged.suspects[0].rank == 3
        # One job verdict for the incident, from the first node to claim it: rank 3 on node-b,
        # first-hand (node-b runs it), with both nodes' evidence directories.
        job_verdicts = list((timeline / ".jobs").glob("*/*/job-verdict.json"))
        assert len(job_verdicts) == 1, logs
        jv = json.loads(job_verdicts[0].read_text())
        assert (jv["culprit"], jv["culprit_node"]) == (3, "node-b"), jv
        # Only node-b filed (first-hand); node-a, which only waited for it, wrote nothing for
        # the job verdict. Every node's directory is still found, by its name.
        assert (jv["nodes"], jv["reports"]) == (["node-b"], 1), jv
        assert jv["evidence"] == [str(verdicts["node-b"][0])]
        dirs = sorted(glob.glob(jv["evidence_glob"]))
        assert dirs == sorted(str(d) for d, _ in verdicts.values()), jv["evidence_glob"]
        reports = list((timeline / ".jobs").glob("*/*/reports/*"))
        assert [p.name.split("~")[0] for p in reports] == ["r3.L.node-b"], reports
        # One taint plan, for the job verdict's culprit node only, from its evidence on the
        # timeline (threshold 1: this single incident is enough), against the in-memory API.
        plans = _taint_plans(tmp_path, timeline, jv["culprit_node"])
        assert "+ taint" in plans[jv["culprit_node"]] and "dry run" in plans[jv["culprit_node"]]
        assert "+ taint" not in plans["node-a"], plans


def test_deaths_in_one_cascade_make_one_incident(tmp_path: Path) -> None:
    """Rank 1 is killed on node-a; gloo then fails node-b's ranks (their peer's sockets
    closed) a moment later. Both agents see deaths, node-b's later: one incident, one job
    verdict naming rank 1 on node-a, and node-b files nothing (its death came after the one
    already reported)."""
    timeline = tmp_path / "timeline"
    with two_nodes(tmp_path, "exit", 1) as (agents, _):
        for a in agents:
            a.wait(timeout=180)
        verdicts = _verdicts(timeline)
        logs = {n: (tmp_path / f"agent-{n}.log").read_text()[-2000:] for n in ("node-a", "node-b")}
        assert set(verdicts) == {"node-a", "node-b"}, logs
        a, b = verdicts["node-a"][1], verdicts["node-b"][1]
        assert (a["kind"], a["culprit"]) == ("rank_exited", 1), a["summary"]
        assert b["kind"] == "rank_exited" and b["culprit"] is None, b["summary"]
        assert "part of job incident a0-rank_exited: rank 1 on node node-a" in b["summary"]
        assert a["incident_id"] == b["incident_id"] == "mn-a0-rank_exited"
        job_verdicts = list((timeline / ".jobs").glob("*/*/job-verdict.json"))
        assert len(job_verdicts) == 1, logs
        jv = json.loads(job_verdicts[0].read_text())
        assert (jv["culprit"], jv["culprit_node"], jv["reports"]) == (1, "node-a", 1), jv
        assert sorted(glob.glob(jv["evidence_glob"])) == sorted(
            str(d) for d, _ in verdicts.values()
        )
