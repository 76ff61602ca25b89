"""The ValidatingAdmissionPolicy of deploy/k8s/policy, evaluated by a real CEL evaluator
(cel-python) the way the API server does (tests/celadmission.py).

The objects are what the agent really sends: the node after the JSON merge patch that
`agent/kube.py` builds from a real plan, and the Event it posts."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
from celadmission import admit, load_policies, merge_patch

from diag.agent.kube import node_patch
from diag.agent.taints import (
    CONDITION_TYPE,
    Evidence,
    JobBudget,
    NodeView,
    Signal,
    Taint,
    TaintPolicy,
    plan_taint,
    plan_untaint,
)

POLICY_FILE = Path(__file__).resolve().parents[1] / "deploy/k8s/policy/admission-policy.yaml"
AGENT = "system:serviceaccount:training:diag-agent"


def policies() -> dict[str, dict]:
    return load_policies(POLICY_FILE)


def node(name: str = "node-a", **extra: Any) -> dict:
    n = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": "7",
            "labels": {"kubernetes.io/hostname": name, "gpu": "h100"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}
            ]
        },
    }
    n.update(extra)
    return n


def view_of(n: dict) -> NodeView:
    taints = tuple(
        Taint(t["key"], t["effect"], t.get("value", "")) for t in n["spec"].get("taints", [])
    )
    return NodeView(n["metadata"]["name"], taints=taints)


def tainted(n: dict) -> dict:
    ev = [Evidence(Signal.GPU_XID, time.time(), xid=79, incident_id="i", incident_path="/t/i")]
    plan = plan_taint(view_of(n), ev, TaintPolicy(job="j"), JobBudget(), time.time())
    return merge_patch(n, node_patch(plan, "7"))


NODE_POLICY = "diag-agent-own-node"
EVENT_POLICY = "diag-agent-own-node-events"


def test_the_agent_may_taint_its_own_node():
    old = node()
    new = tainted(old)
    assert [t["key"] for t in new["spec"]["taints"]] == ["nvidia.com/gpu", "diag.dev/unhealthy"]
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a") == (True, [])


def test_and_untaint_it():
    old = tainted(node())
    plan = plan_untaint(view_of(old), time.time())
    new = merge_patch(old, node_patch(plan, "8"))
    assert [t["key"] for t in new["spec"]["taints"]] == ["nvidia.com/gpu"]
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a") == (True, [])


def test_and_set_its_condition():
    old = node()
    new = copy.deepcopy(old)
    new["status"]["conditions"].append(
        {"type": CONDITION_TYPE, "status": "True", "reason": "GpuXidCritical", "message": "x"}
    )
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a", sub="status")[0]


@pytest.mark.parametrize(
    "change, node_name, why",
    [
        (lambda n: n, "node-b", "diag-agent on node node-b may not change node node-a"),
        (lambda n: n, None, "the diag-agent token names no node"),
        (lambda n: n, "", "the diag-agent token names no node"),
        (
            lambda n: n["spec"].update(taints=[]),
            "node-a",
            "may add or remove only the diag.dev/unhealthy taint",
        ),
        (
            lambda n: n["spec"]["taints"].append({"key": "x", "effect": "NoExecute"}),
            "node-a",
            "may add or remove only the diag.dev/unhealthy taint",
        ),
        (
            lambda n: n["metadata"]["labels"].update(gpu="broken"),
            "node-a",
            "may not change node labels",
        ),
        (
            lambda n: n["metadata"]["annotations"].update({"example.com/x": "1"}),
            "node-a",
            "may change only diag.dev/ annotations",
        ),
        (
            lambda n: n["metadata"]["annotations"].pop("node.alpha.kubernetes.io/ttl"),
            "node-a",
            "may change only diag.dev/ annotations",
        ),
        (lambda n: n["spec"].update(unschedulable=True), "node-a", "may not cordon"),
        (
            lambda n: n["status"]["conditions"][0].update(status="False"),
            "node-a",
            "may change only the DiagUnhealthy condition",
        ),
    ],
)
def test_what_the_agent_may_not_do(change, node_name, why):
    old = node()
    new = tainted(old)
    change(new)
    allowed, messages = admit(policies()[NODE_POLICY], new, old, AGENT, node_name)
    assert not allowed
    assert any(why in m for m in messages), messages


def test_other_users_are_not_restricted():
    old = node()
    new = copy.deepcopy(old)
    new["spec"]["unschedulable"] = True
    new["metadata"]["labels"]["gpu"] = "drained"
    for user in (
        "system:node:node-a",
        "admin",
        "system:serviceaccount:kube-system:node-controller",
    ):
        assert admit(policies()[NODE_POLICY], new, old, user, None) == (True, [])


def event(about: str, kind: str = "Node") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{about}.1", "namespace": "default"},
        "involvedObject": {"kind": kind, "name": about},
        "reason": "DiagTainted",
        "message": "m",
        "type": "Warning",
    }


@pytest.mark.parametrize(
    "ev, bound, allowed",
    [
        (event("node-a"), "node-a", True),
        (event("node-b"), "node-a", False),
        (event("node-a", kind="Pod"), "node-a", False),
        (event("node-a"), None, False),
    ],
)
def test_events_only_about_its_own_node(ev, bound, allowed):
    assert admit(policies()[EVENT_POLICY], ev, None, AGENT, bound)[0] is allowed
    assert admit(policies()[EVENT_POLICY], ev, None, "admin", None)[0]
