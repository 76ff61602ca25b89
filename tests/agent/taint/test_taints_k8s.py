"""Node taints against a Kubernetes API with the real `kubernetes` client: the in-memory API
server (tests/support/cluster/kubesim.py, kmock) by default, a real cluster when KUBECONFIG is set.

Agents are real `diag taint` / `diag untaint` processes; the job's ledger lives in a real
timeline directory shared by them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from culpritincident import write_incident
from jobrun import free_port
from kubecluster import cluster

from diag.agent.node.linkstate import NicState
from diag.agent.precheck.measurements import Severity
from diag.agent.precheck.report import NodeReport, Outcome, PrecheckReport
from diag.agent.taint.flow import taint
from diag.agent.taint.kube import apply_plan, connect
from diag.agent.taint.planner import (
    CONDITION_TYPE,
    RECORD_ANNOTATION,
    TAINT_KEY,
    Evidence,
    JobBudget,
    Signal,
    TaintPolicy,
    plan_taint,
)
from diag.agent.taint.taintconfig import TaintSettings
from diag.formats import exitcodes

pytestmark = pytest.mark.k8s

OTHER_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
READY = {
    "type": "Ready",
    "status": "True",
    "reason": "KubeletReady",
    "message": "kubelet is posting ready status",
    "lastHeartbeatTime": "2026-11-24T07:00:00Z",
    "lastTransitionTime": "2026-11-24T06:00:00Z",
}


@pytest.fixture
def kube(tmp_path):
    with cluster(tmp_path) as c:
        yield c


def diag(kube, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": kube.kubeconfig}
    env.pop("NODE_NAME", None)
    return subprocess.run(
        [sys.executable, "-m", "diag.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def keys(node) -> list[str]:
    """Taint keys, without those a real cluster's node controller puts on node objects that
    have no kubelet (node.kubernetes.io/not-ready, unreachable)."""
    return [t.key for t in node.spec.taints or [] if not t.key.startswith("node.kubernetes.io/")]


def ours(node) -> list:
    return [t for t in node.spec.taints or [] if t.key == TAINT_KEY]


def condition(node):
    return next((c for c in node.status.conditions or [] if c.type == CONDITION_TYPE), None)


def test_culprit_node_tainted_with_condition_and_event(kube, tmp_path):
    n1 = kube.create_node("a", taints=[OTHER_TAINT], conditions=[READY])
    n2 = kube.create_node("b", conditions=[READY])
    before_n2 = kube.node(n2)
    timeline = tmp_path / "timeline"
    dirs = [write_incident(timeline, n1, f"inc-{i}") for i in range(3)]
    write_incident(timeline, n2, "inc-other", rank=4)  # another node's culprit: not n1's

    dry = diag(kube, "taint", "--node", n1, "--job", "llm", "--timeline", str(timeline),
               "--no-gpu-probe", "--dry-run")  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert f"node {n1}: taint: culprit of 3 incidents" in dry.stdout
    assert f"+ taint {TAINT_KEY}=RepeatedCulprit:NoSchedule" in dry.stdout
    assert "dry run: nothing changed" in dry.stdout
    assert not ours(kube.node(n1)) and condition(kube.node(n1)) is None

    res = diag(kube, "taint", "--node", n1, "--job", "llm", "--timeline", str(timeline),
               "--no-gpu-probe")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "applied" in res.stdout

    node = kube.node(n1)
    assert [(t.key, t.value, t.effect) for t in ours(node)] == [
        (TAINT_KEY, "RepeatedCulprit", "NoSchedule")
    ]
    assert any(t.key == "nvidia.com/gpu" for t in node.spec.taints)  # kept
    cond = condition(node)
    assert cond is not None and cond.status == "True" and cond.reason == "RepeatedCulprit"
    assert "inc-0, inc-1, inc-2" in cond.message
    assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
    record = json.loads(node.metadata.annotations[RECORD_ANNOTATION])
    assert record["job"] == "llm" and record["reason"] == "RepeatedCulprit"
    assert record["incident_path"] in {str(d) for d in dirs}

    events = kube.events_for(n1)
    assert len(events) == 1
    ev = events[0]
    assert ev.reason == "DiagTainted" and ev.type == "Warning"
    assert ev.involved_object.kind == "Node" and ev.involved_object.uid == node.metadata.uid
    assert record["incident_id"] in ev.message and record["incident_path"] in ev.message
    assert ev.metadata.annotations["diag.dev/incident-id"] == record["incident_id"]
    assert ev.metadata.annotations["diag.dev/incident-path"] == record["incident_path"]

    # No other node touched.
    after_n2 = kube.node(n2)
    assert not ours(after_n2) and condition(after_n2) is None and not kube.events_for(n2)
    if not kube.real:
        assert after_n2.metadata.resource_version == before_n2.metadata.resource_version

    # The same evidence again: nothing changes, no second Event.
    again = diag(kube, "taint", "--node", n1, "--job", "llm", "--timeline", str(timeline),
                 "--no-gpu-probe")  # fmt: skip
    assert again.returncode == 0 and "already tainted" in again.stdout
    assert len(kube.events_for(n1)) == 1


def test_concurrent_patch_is_retried(kube, tmp_path):
    """A second writer (another agent's patch of the same node) lands between our read and our
    write: the API server refuses our stale write, we read again, plan again, and keep both."""
    name = kube.create_node("c", conditions=[READY])
    second_agent = connect(kube.kubeconfig)
    policy = TaintPolicy(job="llm")
    xid = [Evidence(Signal.GPU_XID, time.time(), xid=79, gpu=2, incident_id="inc-7")]
    seen = []

    def decide(view):
        seen.append(
            tuple(t.key for t in view.taints if not t.key.startswith("node.kubernetes.io/"))
        )
        if len(seen) == 1:
            node = second_agent.read_node(name)
            second_agent.patch_node(
                name,
                {
                    "metadata": {"resourceVersion": node.metadata.resource_version},
                    "spec": {
                        "taints": [{"key": "example.com/maintenance", "effect": "NoSchedule"}]
                    },
                },
                _content_type="application/merge-patch+json",
            )
        return plan_taint(view, xid, policy, JobBudget(), time.time())

    result = apply_plan(connect(kube.kubeconfig), name, decide, retries=3)
    assert result.applied and result.attempts == 2
    assert seen == [(), ("example.com/maintenance",)]  # planned again from the new state
    assert sorted(keys(kube.node(name))) == sorted(["example.com/maintenance", TAINT_KEY])
    assert len(kube.events_for(name)) == 1


def test_two_agents_racing_on_one_node(kube, tmp_path):
    """Two real `diag taint` processes (an XID and an ECC report) on one node at once: both
    pieces of evidence end up in the record, one taint, no write lost."""
    name = kube.create_node("r", conditions=[READY])
    timeline = tmp_path / "timeline"
    base = ["taint", "--node", name, "--job", "llm", "--timeline", str(timeline), "--no-gpu-probe"]
    with ThreadPoolExecutor(2) as pool:
        runs = list(
            pool.map(lambda extra: diag(kube, *base, *extra), [["--xid", "79@1"], ["--ecc", "3@0"]])
        )
    for r in runs:
        assert r.returncode == 0, r.stderr
    node = kube.node(name)
    assert len(ours(node)) == 1
    record = json.loads(node.metadata.annotations[RECORD_ANNOTATION])
    # The second planned from the first's record: both pieces of evidence are in it.
    assert sorted(record["evidence"]) == sorted(
        ["GPU 0: 3 uncorrected ECC errors (reported)", "XID 79 on GPU 1 (reported)"]
    )
    assert record["reason"] == "GpuEccUncorrected"  # the weightier of the two
    assert sorted(e.reason for e in kube.events_for(name)) == ["DiagTaintUpdated", "DiagTainted"]


@pytest.mark.slow
def test_job_cap_holds_across_concurrent_agents(kube, tmp_path):
    names = [kube.create_node(f"cap{i}", conditions=[READY]) for i in range(3)]
    timeline = tmp_path / "timeline"

    def agent(name):
        return diag(kube, "taint", "--node", name, "--job", "llm", "--timeline", str(timeline),
                    "--no-gpu-probe", "--xid", "79", "--taint-job-cap", "2",
                    "--taint-rate-count", "10")  # fmt: skip

    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(agent, names))
    for r in runs:
        assert r.returncode == 0, r.stderr
    tainted = [n for n in names if ours(kube.node(n))]
    blocked = [n for n in names if not ours(kube.node(n))]
    assert len(tainted) == 2 and len(blocked) == 1
    node = kube.node(blocked[0])
    cond = condition(node)
    # The evidence is still on the blocked node, as a condition and an Event.
    assert cond is not None and cond.status == "True" and "job-cap" in cond.message
    assert [e.reason for e in kube.events_for(blocked[0])] == ["DiagTaintBlocked"]
    assert RECORD_ANNOTATION not in (node.metadata.annotations or {})

    # Another job has a cap of its own.
    other = diag(kube, "taint", "--node", blocked[0], "--job", "other", "--timeline",
                 str(timeline), "--no-gpu-probe", "--xid", "79")  # fmt: skip
    assert other.returncode == 0 and ours(kube.node(blocked[0]))

    # Untainting gives the slot back.
    r = diag(kube, "untaint", "--node", tainted[0], "--timeline", str(timeline))
    assert r.returncode == 0, r.stderr
    assert not ours(kube.node(tainted[0]))
    ledger = timeline / ".taints" / "llm"
    assert sorted(p.stem for p in ledger.glob("*.json")) == [tainted[1]]


def test_rate_limit(kube, tmp_path):
    a, b = kube.create_node("ra"), kube.create_node("rb")
    timeline = tmp_path / "timeline"
    common = ["--job", "llm", "--timeline", str(timeline), "--no-gpu-probe", "--ecc", "1",
              "--taint-rate-count", "1", "--taint-rate-window", "600"]  # fmt: skip
    assert diag(kube, "taint", "--node", a, *common).returncode == 0
    second = diag(kube, "taint", "--node", b, *common)
    assert second.returncode == 0, second.stderr
    assert "blocked" in second.stdout and "rate-limit" in second.stdout
    assert ours(kube.node(a)) and not ours(kube.node(b))


def test_untaint_keeps_other_taints_and_posts_event(kube, tmp_path):
    name = kube.create_node("u", taints=[OTHER_TAINT], conditions=[READY])
    timeline = tmp_path / "timeline"
    r = diag(kube, "taint", "--node", name, "--job", "llm", "--timeline", str(timeline),
             "--no-gpu-probe", "--xid", "79@0")  # fmt: skip
    assert r.returncode == 0 and ours(kube.node(name))
    dry = diag(kube, "untaint", "--node", name, "--timeline", str(timeline), "--dry-run")
    assert "untaint" in dry.stdout and ours(kube.node(name))
    r = diag(
        kube, "untaint", "--node", name, "--timeline", str(timeline), "--reason", "GPU 0 replaced"
    )
    assert r.returncode == 0, r.stderr
    node = kube.node(name)
    assert not ours(node) and keys(node) == ["nvidia.com/gpu"]
    assert RECORD_ANNOTATION not in (node.metadata.annotations or {})
    cond = condition(node)
    assert cond.status == "False" and cond.reason == "ManualUntaint"
    assert "GPU 0 replaced" in cond.message
    ev = [e for e in kube.events_for(name) if e.reason == "DiagUntainted"]
    assert len(ev) == 1 and ev[0].type == "Normal"


def test_expiry_and_clean_precheck_untaint(kube, tmp_path):
    a, b = kube.create_node("ea"), kube.create_node("eb")
    timeline = tmp_path / "timeline"
    api = connect(kube.kubeconfig)
    settings = TaintSettings(policy=TaintPolicy(job="llm", expiry=60, rate_count=10))
    t0 = time.time()
    xid = [Evidence(Signal.GPU_XID, t0, xid=79)]
    for n in (a, b):
        out = taint(settings, n, timeline, xid, dry_run=False, api=api, clock=lambda: t0)
        assert out.applied and ours(kube.node(n))
    # a: an hour later, no new evidence: expired.
    out = taint(settings, a, timeline, [], dry_run=False, api=api, clock=lambda: t0 + 3600)
    assert out.applied and out.plan.condition.reason == "Expired"
    assert not ours(kube.node(a))
    # b: a clean precheck after the taint clears it at once.
    report = PrecheckReport(
        job="llm",
        nnodes=1,
        reported_by=0,
        outcome=Outcome.HEALTHY,
        started_at=t0 + 5,
        wall_seconds=20,
        nodes=(
            NodeReport(
                node=0,
                status=Severity.HEALTHY,
                reason="",
                host=b,
                nic=NicState("eth0", carrier=True),
            ),
        ),
    )
    path = tmp_path / "precheck.json"
    path.write_text(json.dumps(report.to_dict(), default=str))
    r = diag(kube, "taint", "--node", b, "--job", "llm", "--timeline", str(timeline),
             "--no-gpu-probe", "--precheck-report", str(path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    node = kube.node(b)
    assert not ours(node) and condition(node).reason == "PrecheckClean"
    # Both slots are free again.
    assert not list((timeline / ".taints" / "llm").glob("*.json"))


def test_expired_sweep(kube, tmp_path):
    """`diag untaint --expired` (the CronJob): expired taints go, live ones and others' stay."""
    old, live = kube.create_node("old", taints=[OTHER_TAINT]), kube.create_node("live")
    bystander = kube.create_node("by", taints=[OTHER_TAINT])
    timeline = tmp_path / "timeline"
    api = connect(kube.kubeconfig)
    t0 = time.time()
    xid = [Evidence(Signal.GPU_XID, t0, xid=79)]
    short = TaintSettings(policy=TaintPolicy(job="llm", expiry=1, rate_count=10))
    long = TaintSettings(policy=TaintPolicy(job="llm", expiry=3600, rate_count=10))
    assert taint(short, old, timeline, xid, dry_run=False, api=api, clock=lambda: t0 - 60).applied
    assert taint(long, live, timeline, xid, dry_run=False, api=api).applied
    args = ["untaint", "--expired", "--timeline", str(tmp_path / "cron")]
    if kube.real:  # a real cluster's other nodes are not ours to sweep
        runs = [diag(kube, *args, "--node", n) for n in (old, live, bystander)]
    else:
        dry = diag(kube, *args, "--dry-run")
        assert dry.returncode == 0 and f"node {old}: untaint: the taint expired" in dry.stdout
        assert ours(kube.node(old))
        runs = [diag(kube, *args)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert not ours(kube.node(old)) and condition(kube.node(old)).reason == "Expired"
    assert keys(kube.node(old)) == ["nvidia.com/gpu"]
    assert ours(kube.node(live))
    assert keys(kube.node(bystander)) == ["nvidia.com/gpu"]
    assert not kube.events_for(bystander)


def test_precheck_faulty_and_no_carrier_taint(kube, tmp_path):
    name = kube.create_node("p")
    report = PrecheckReport(
        job="llm",
        nnodes=2,
        reported_by=1,
        outcome=Outcome.FAULTY,
        faulty=(1,),
        started_at=time.time(),
        nodes=(
            NodeReport(node=0, status=Severity.HEALTHY, reason="", host="other"),
            NodeReport(
                node=1,
                status=Severity.FAULTY,
                reason="nic: no carrier on eth1",
                host=name,
                nic=NicState("eth1", operstate="down", carrier=False),
            ),
        ),
    )
    path = tmp_path / "precheck.json"
    path.write_text(json.dumps(report.to_dict(), default=str))
    r = diag(kube, "taint", "--node", name, "--job", "llm", "--timeline", str(tmp_path / "t"),
             "--no-gpu-probe", "--precheck-report", str(path), "--taint-no-execute", "true")  # fmt: skip
    assert r.returncode == 0, r.stderr
    effects = sorted((t.value, t.effect) for t in ours(kube.node(name)))
    # No carrier is a confirmed hardware fault: NoExecute too, as configured.
    assert effects == [("NicNoCarrier", "NoExecute"), ("NicNoCarrier", "NoSchedule")]
    assert "precheck: faulty (nic: no carrier on eth1)" in condition(kube.node(name)).message


def test_bad_input_is_a_clear_error(kube, tmp_path):
    r = diag(kube, "taint", "--job", "llm", "--no-gpu-probe", "--dry-run")
    assert r.returncode == exitcodes.USAGE and "pass --node or set NODE_NAME" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = diag(kube, "taint", "--node", "x", "--precheck-report", str(bad), "--no-gpu-probe")
    assert r.returncode == exitcodes.USAGE and "not a diag precheck report" in r.stderr
    r = diag(kube, "taint", "--node", "x", "--xid", "seventy", "--no-gpu-probe")
    assert r.returncode == exitcodes.USAGE and "--xid 'seventy'" in r.stderr
    r = diag(kube, "taint", "--node", "x", "--taint-job-cap", "-1", "--no-gpu-probe")
    assert r.returncode == exitcodes.USAGE and "--taint-job-cap" in r.stderr
    r = diag(kube, "taint", "--node", kube.node_name("absent"), "--no-gpu-probe", "--dry-run",
             "--timeline", str(tmp_path))  # fmt: skip
    assert r.returncode == exitcodes.KUBE_ERROR and "HTTP 404" in r.stderr
    assert "Traceback" not in r.stderr
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    n = kube.create_node("bad")
    r = diag(
        kube, "taint", "--node", n, "--timeline", str(blocked), "--no-gpu-probe", "--xid", "79"
    )
    assert r.returncode == exitcodes.USAGE and "cannot use the timeline" in r.stderr
    assert "Traceback" not in r.stderr and not ours(kube.node(n))


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)
def test_agent_taints_its_node_after_an_incident(kube, tmp_path):
    """A real agent watching a real 2-rank job whose rank 1 hangs: the incident names rank 1,
    which runs on this node, so the agent taints its node with the incident as evidence. The
    long tier: the default tier has a real agent tainting its node from an incident across two
    nodes (test_taint_jobverdict) and the own-verdict rule apart."""
    from diag.agent.observe.procs import stop_tree

    name = kube.create_node("agent", conditions=[READY])
    other = kube.create_node("bystander", conditions=[READY])
    run_dir, timeline = tmp_path / "run", tmp_path / "timeline"
    env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_JOB="taintjob", OMP_NUM_THREADS="1",
               KUBECONFIG=kube.kubeconfig)  # fmt: skip
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "diag.trainer.demo_job", "--fault", "hang",
         "--fault-rank", "1", "--fault-step", "3", "--steps", "1000"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        agent = subprocess.run(
            [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
             "--timeline", str(timeline), "--job", "taintjob", "--node", name,
             "--until", "incident", "--hang-timeout", "8", "--hang-floor", "3",
             "--warmup-timeout", "20", "--native-stacks", "false", "--control", "false",
             "--taint-mode", "on", "--taint-culprit-threshold", "1"],
            env=env, capture_output=True, text=True, timeout=200,
        )  # fmt: skip
    finally:
        stop_tree(job.pid, grace=5)
        job.wait(timeout=30)
    assert agent.returncode == exitcodes.HANG_DETECTED, agent.stderr[-3000:]
    incident = next(p for p in timeline.iterdir() if not p.name.startswith("."))
    verdict = json.loads((incident / "verdict.json").read_text())
    assert verdict["culprit"] == 1
    node = kube.node(name)
    assert [(t.value, t.effect) for t in ours(node)] == [("RepeatedCulprit", "NoSchedule")]
    record = json.loads(node.metadata.annotations[RECORD_ANNOTATION])
    assert record["job"] == "taintjob" and record["incident_path"] == str(incident)
    assert record["incident_id"] == verdict["incident_id"]
    assert [e.reason for e in kube.events_for(name)] == ["DiagTainted"]
    assert not ours(kube.node(other)) and not kube.events_for(other)
    assert "taint:" in agent.stderr
