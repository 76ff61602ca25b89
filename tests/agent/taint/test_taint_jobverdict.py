"""The job verdict as taint evidence: the agent on the culprit's node counts an incident against
its own node when the job verdict names it, even where its own verdict blamed none of its ranks.

The end-to-end case is a real deadlock across two "nodes" (two torchrun launchers and two
`diag agent` processes on this host, sharing the timeline as a cluster shares a volume): rank 3
on node-b takes the second group's all-reduce while ranks 0-2 wait in the first's. Node-b's own
agent sees its ranks 2 and 3 wait for each other with neither standing out, node-a's sees its
ranks wait for node-b's; only the job verdict, over both nodes' views, names rank 3 on node-b.
The agent on node-b then taints node-b, and nothing else is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from children import stop_jobs_and_agents
from jobrun import free_port
from kubecluster import cluster
from repo import SUPPORT

from diag.agent.detect.hang import Verdict, VerdictKind
from diag.agent.evidence.collection import EvidenceResult, IncidentReport
from diag.agent.job.silence import LostNode
from diag.agent.job.verdict import JobVerdictStore, NodeReport, Where
from diag.agent.taint.evidencesources import culprit_history, from_job_verdicts
from diag.agent.taint.planner import RECORD_ANNOTATION, TAINT_KEY, Signal, TaintPolicy
from diag.agent.taint.step import NodeTainter
from diag.agent.taint.taintconfig import TaintMode, TaintSettings
from diag.formats.stackdump import RankDump

JOB = "mn"
WAIT_JOB = SUPPORT / "jobs" / "wait_job.py"


def _report(tmp: Path, node: str, ranks: tuple[int, ...], culprit: int | None) -> IncidentReport:
    """What the agent's executor hands its listeners: the verdict and the incident directory
    with one stack dump per local rank."""
    path = tmp / "timeline" / f"20261125-120000-hang-{node}"
    path.mkdir(parents=True)
    verdict = Verdict(
        kind=VerdictKind.HANG,
        incident_id="a0-hang-pg0-seq6",
        at=0.0,
        culprit=culprit,
        suspects=(),
        overdue=(),
        waits=(),
        summary="hang: no single culprit",
    )
    dumps = tuple(RankDump(rank=r, world_size=4, pid=100 + r, node=node) for r in ranks)
    return IncidentReport(verdict, EvidenceResult(path, dumps, 0.0, 0.0, 0.0), JOB, node)


def _decide(tmp: Path, culprit: int, node: str, incident: str = "a0-hang-pg0-seq6") -> None:
    """A job verdict reached the way the agents reach it: the culprit's node files a report
    that blames its own rank, and the claimant concludes."""
    store = JobVerdictStore(tmp / "timeline" / ".jobs")
    evidence = str(tmp / "timeline" / f"e-{node}")
    store.file(JOB, incident, NodeReport(node, culprit, Where.LOCAL, evidence))
    assert store.conclude(JOB, incident, first_seen=time.time(), now_wall=time.time(), force=True)


def _tainter(tmp: Path, node: str, settle: float = 0.2) -> NodeTainter:
    settings = TaintSettings(mode=TaintMode.DRY_RUN, policy=TaintPolicy(job=JOB))
    store = JobVerdictStore(tmp / "timeline" / ".jobs", settle=settle, poll=0.05)
    return NodeTainter(settings, node, tmp / "timeline", store, job_verdict_slack=0.5)


def test_own_verdict_blaming_a_local_rank_needs_no_job_verdict(tmp_path: Path) -> None:
    report = _report(tmp_path, "node-b", (2, 3), culprit=3)
    ev = _tainter(tmp_path, "node-b").incident_evidence(report)
    assert ev is not None and ev.signal == Signal.CULPRIT
    assert ev.incident_id == f"{JOB}-a0-hang-pg0-seq6"
    assert ev.incident_path == str(report.evidence.path)


def test_job_verdict_naming_this_node_counts_against_it(tmp_path: Path) -> None:
    report = _report(tmp_path, "node-b", (2, 3), culprit=None)
    _decide(tmp_path, 3, "node-b")
    ev = _tainter(tmp_path, "node-b").incident_evidence(report)
    assert ev is not None and ev.signal == Signal.CULPRIT
    # The id the incident directories carry, so it counts once with them; the path is this
    # node's own evidence of the incident.
    assert ev.incident_id == f"{JOB}-a0-hang-pg0-seq6"
    assert ev.incident_path == str(report.evidence.path)
    assert "rank 3" in ev.detail


def test_job_verdict_naming_another_node_counts_against_none(tmp_path: Path) -> None:
    report = _report(tmp_path, "node-a", (0, 1), culprit=None)
    _decide(tmp_path, 3, "node-b")
    assert _tainter(tmp_path, "node-a").incident_evidence(report) is None
    # A remote culprit named by this node's own verdict is no evidence against this node.
    report = _report(tmp_path / "x", "node-a", (0, 1), culprit=3)
    assert _tainter(tmp_path / "x", "node-a").incident_evidence(report) is None


@pytest.mark.timeout(60)
def test_waiting_for_a_job_verdict_that_never_comes_is_bounded(tmp_path: Path) -> None:
    report = _report(tmp_path, "node-b", (2, 3), culprit=None)
    tainter = _tainter(tmp_path, "node-b", settle=0.2)
    t0 = time.monotonic()
    assert tainter.incident_evidence(report) is None
    assert time.monotonic() - t0 >= tainter.job_verdict_wait - 0.1  # it did wait


def test_history_counts_each_incident_once(tmp_path: Path) -> None:
    """An incident that its own verdict and the job verdict both pin on node-b counts once;
    job verdicts naming other nodes count for them."""
    timeline = tmp_path / "timeline"
    _decide(tmp_path, 3, "node-b", "a0-hang-pg0-seq6")
    _decide(tmp_path, 3, "node-b", "a0-hang-pg0-seq9")
    _decide(tmp_path, 1, "node-a", "a0-hang-pg0-seq12")
    own = timeline / "20261125-120000-hang-node-b"
    own.mkdir()
    (own / "verdict.json").write_text(
        json.dumps(
            {
                "incident_id": f"{JOB}-a0-hang-pg0-seq6",
                "node": "node-b",
                "culprit": 3,
                "summary": "",
            }
        )
    )
    (own / "00003-00004.stack.json").write_text("{}")
    from_jobs = from_job_verdicts(timeline, "node-b", since=0)
    assert sorted(e.incident_id for e in from_jobs) == [
        f"{JOB}-a0-hang-pg0-seq6",
        f"{JOB}-a0-hang-pg0-seq9",
    ]
    history = {e.incident_id: e for e in culprit_history(timeline, "node-b", since=0)}
    assert sorted(history) == [f"{JOB}-a0-hang-pg0-seq6", f"{JOB}-a0-hang-pg0-seq9"]
    # The incident's own directory is the evidence where the node has one.
    assert history[f"{JOB}-a0-hang-pg0-seq6"].incident_path == str(own)
    assert [e.incident_id for e in culprit_history(timeline, "node-a", 0)] == [
        f"{JOB}-a0-hang-pg0-seq12"
    ]
    assert culprit_history(timeline, "node-b", since=time.time() + 60) == []


def _death(tmp: Path, node: str, rank: int) -> IncidentReport:
    """node's own verdict of a death: its rank died (first-hand), its stack dump is there."""
    report = _report(tmp, node, (rank,), culprit=rank)
    verdict = replace(report.verdict, kind=VerdictKind.RANK_EXITED, incident_id=DEATH_ID,
                      summary=f"rank {rank} exited")  # fmt: skip
    assert report.evidence is not None
    (report.evidence.path / "verdict.json").write_text(json.dumps({
        "incident_id": f"{JOB}-{DEATH_ID}", "node": node, "culprit": rank, "summary": "",
    }))  # fmt: skip
    (report.evidence.path / f"{rank:05d}-00004.stack.json").write_text("{}")
    return replace(report, verdict=verdict)


DEATH_ID = "a0-rank_exited"


def test_a_death_after_a_node_went_silent_counts_against_the_lost_node_only(
    tmp_path: Path,
) -> None:
    """node-a's rank died when node-b vanished whole: node-a's own verdict blames its rank
    first-hand, but the job verdict names node-b, whose agent went silent. node-a is not
    tainted for it: neither the incident nor its own directory counts against it."""
    report = _death(tmp_path, "node-a", 0)
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=0.2, poll=0.05, cascade=0.0)
    store.file(JOB, DEATH_ID, NodeReport("node-a", 0, Where.LOCAL, str(report.evidence.path)))
    v = store.wait_and_conclude(JOB, DEATH_ID, time.time(), None, (LostNode("node-b", (2,), 5.0),))
    assert v is not None and v.culprit_node == "node-b"
    assert _tainter(tmp_path, "node-a").incident_evidence(report) is None
    timeline = tmp_path / "timeline"
    assert culprit_history(timeline, "node-a", since=0) == []
    # The lost node, should its agent come back, finds the incident against it.
    assert [e.incident_id for e in culprit_history(timeline, "node-b", 0)] == [f"{JOB}-{DEATH_ID}"]


def test_a_death_without_a_lost_node_still_counts_against_its_own_node(tmp_path: Path) -> None:
    report = _death(tmp_path, "node-a", 0)
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=0.2, poll=0.05, cascade=0.0)
    store.file(JOB, DEATH_ID, NodeReport("node-a", 0, Where.LOCAL, str(report.evidence.path)))
    assert store.wait_and_conclude(JOB, DEATH_ID, time.time()) is not None
    ev = _tainter(tmp_path, "node-a").incident_evidence(report)
    assert ev is not None and ev.signal == Signal.CULPRIT
    assert [e.incident_id for e in culprit_history(tmp_path / "timeline", "node-a", 0)] == [
        f"{JOB}-{DEATH_ID}"
    ]


@pytest.mark.slow
@pytest.mark.k8s
@pytest.mark.timeout(300)
def test_agent_on_the_culprit_node_taints_it_from_the_job_verdict(tmp_path: Path) -> None:
    if os.environ.get("KUBECONFIG"):
        pytest.skip("runs against the in-memory API only (the agents' node names are fixed)")
    timeline, port = tmp_path / "timeline", free_port()
    (tmp_path / "kube").mkdir()
    agents: list[subprocess.Popen[bytes]] = []
    jobs: list[subprocess.Popen[bytes]] = []
    with cluster(tmp_path / "kube") as kube:
        kube.prefix = "node"  # the nodes are node-a and node-b
        names = [kube.create_node(short) for short in ("a", "b")]
        try:
            for node_rank, node in enumerate(names):
                run = tmp_path / f"run-{node}"
                env = dict(
                    os.environ, DIAG_RUN_DIR=str(run), DIAG_JOB=JOB, OMP_NUM_THREADS="1",
                    KUBECONFIG=kube.kubeconfig, TMPDIR=str(tmp_path),
                )  # fmt: skip
                log = open(tmp_path / f"agent-{node}.log", "wb")  # noqa: SIM115
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run),
                     "--timeline", str(timeline), "--job", JOB, "--node", node,
                     "--hang-timeout", "20", "--hang-floor", "3", "--warmup-timeout", "60", "--on-hang", "none",
                     "--until", "incident", "--interval", "0.25", "--native-stacks", "false",
                     "--control", "false", "--taint-mode", "on",
                     "--taint-culprit-threshold", "1", "--taint-gpu-watch", "false", "-v"],
                    env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
                # Rank 3 waits 1 s before it takes the other group, so that rank 2 is inside
                # the first by then: both nodes' oldest wait is the same collective, and so is
                # their incident's id.
                jobs.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                     "--node-rank", str(node_rank), "--nproc-per-node", "2", "--master-addr",
                     "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
                     str(WAIT_JOB), "--scenario", "groups", "--fault-rank", "3",
                     "--fault-step", "6", "--fault-delay", "1", "--pg-timeout", "120"],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True))  # fmt: skip
            for a in agents:
                a.wait(timeout=200)
        finally:
            stop_jobs_and_agents(jobs, agents)
        logs = "\n".join(
            f"--- {n}\n{(tmp_path / f'agent-{n}.log').read_text(errors='replace')[-3000:]}"
            for n in names
        )
        verdicts = {}
        for d in timeline.iterdir():
            if (d / "verdict.json").exists():
                v = json.loads((d / "verdict.json").read_text())
                verdicts[v["node"]] = (d, v)
        assert set(verdicts) == set(names), logs
        (_, a), (dir_b, b) = verdicts["node-a"], verdicts["node-b"]
        # Neither node blames one of its own ranks.
        assert a["culprit"] is None and b["culprit"] is None, (a["summary"], b["summary"])
        assert "no rank on the cycle stands out" in b["summary"], b["summary"]
        assert a["incident_id"] == b["incident_id"], logs
        (path,) = timeline.glob(".jobs/*/*/job-verdict.json")
        jv = json.loads(path.read_text())
        assert (jv["culprit"], jv["culprit_node"]) == (3, "node-b"), jv

        node_b = kube.node("node-b")
        assert [(t.value, t.effect) for t in node_b.spec.taints or [] if t.key == TAINT_KEY] == [
            ("RepeatedCulprit", "NoSchedule")
        ], logs
        record = json.loads(node_b.metadata.annotations[RECORD_ANNOTATION])
        assert record["incident_id"] == b["incident_id"] and record["job"] == JOB
        assert record["incident_path"] == str(dir_b)
        assert [e.reason for e in kube.events_for("node-b")] == ["DiagTainted"]
        # One taint for the job-wide hang: node-a is not touched.
        node_a = kube.node("node-a")
        assert not node_a.spec.taints and not kube.events_for("node-a")
        assert RECORD_ANNOTATION not in (node_a.metadata.annotations or {})
        assert "names rank 3 on node node-b, not this node" in logs


@pytest.mark.k8s
@pytest.mark.timeout(120)
def test_a_job_verdict_naming_the_worker_taints_the_kubernetes_node_it_runs_on(
    tmp_path: Path,
) -> None:
    """--node names the worker's place in the job (worker-1, kept across a replacement), while
    the taint goes on the Kubernetes node the agent runs on (--taint-kube-node)."""
    (tmp_path / "kube").mkdir()
    with cluster(tmp_path / "kube") as kube:
        k8s_node = kube.create_node("host-7")
        report = _report(tmp_path, "worker-1", (2, 3), culprit=None)
        _decide(tmp_path, 3, "worker-1")
        settings = TaintSettings(
            mode=TaintMode.ON,
            policy=TaintPolicy(job=JOB, culprit_threshold=1),
            kubeconfig=kube.kubeconfig,
            kube_node=k8s_node,
        )
        store = JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=0.2, poll=0.05)
        tainter = NodeTainter(
            settings, "worker-1", tmp_path / "timeline", store, job_verdict_slack=0.5
        )
        ev = tainter.incident_evidence(report)
        assert ev is not None and ev.signal == Signal.CULPRIT  # the job's name for the node
        out = tainter.plan([ev], job=JOB)
        assert out is not None and out.plan.changes_node
        taints = kube.node(k8s_node).spec.taints or []
        assert [t.key for t in taints] == [TAINT_KEY]
