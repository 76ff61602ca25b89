"""The ValidatingAdmissionPolicy of deploy/k8s/policy, evaluated by a real CEL evaluator
(cel-python) the way the API server does (tests/support/cluster/celadmission.py).

The objects are what the agent really sends: the node after the JSON merge patch that
`diag/agent/taint/kube.py` builds from a real plan, and the Event it posts."""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import pytest
from celadmission import admit, load_policies, merge_patch
from repo import ROOT

from diag.agent.taint.kube import node_patch
from diag.agent.taint.planner import (
    CONDITION_TYPE,
    MAX_EXPIRY,
    RECORD_ANNOTATION,
    RECORD_MAX_CHARS,
    TAINT_KEY,
    Evidence,
    JobBudget,
    NodeView,
    Signal,
    Taint,
    TaintPolicy,
    TaintRecord,
    plan_taint,
    plan_untaint,
)

POLICY_FILE = ROOT / "deploy/k8s/policy/admission-policy.yaml"
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
            "may change only the diag.dev/taint-record annotation",
        ),
        (
            lambda n: n["metadata"]["annotations"].pop("node.alpha.kubernetes.io/ttl"),
            "node-a",
            "may change only the diag.dev/taint-record annotation",
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


# What a token may do on its own node: diag's taint and effects, diag's record, bounded.


def record_of(n: dict) -> dict:
    return json.loads(n["metadata"]["annotations"][RECORD_ANNOTATION])


def with_record(n: dict, **fields: Any) -> dict:
    out = copy.deepcopy(n)
    rec = {**record_of(out), **fields}
    text = json.dumps(rec, sort_keys=True, separators=(",", ":"))
    out["metadata"]["annotations"][RECORD_ANNOTATION] = text
    return out


def evicting(n: dict, ev: list[Evidence], **policy: Any) -> dict:
    plan = plan_taint(view_of(n), ev, TaintPolicy(job="j", **policy), JobBudget(), time.time())
    return merge_patch(n, node_patch(plan, "7"))


def hardware_fault() -> list[Evidence]:
    return [Evidence(Signal.GPU_XID, time.time(), xid=79, incident_id="i", incident_path="/t/i")]


def test_the_agent_may_evict_for_a_confirmed_hardware_fault():
    old = node()
    new = evicting(old, hardware_fault(), no_execute=True)
    effects = {t["effect"] for t in new["spec"]["taints"] if t["key"] == TAINT_KEY}
    assert effects == {"NoSchedule", "NoExecute"}
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a") == (True, [])


def diag_taint(effect: str) -> dict:
    return {"key": TAINT_KEY, "value": "GpuXidCritical", "effect": effect}


@pytest.mark.parametrize(
    "change, why",
    [
        # Another key: the node's other taints are not the agent's to change.
        (
            lambda n: n["spec"]["taints"].append(
                {"key": "evict.example/all", "effect": "NoExecute"}
            ),
            "may add or remove only the diag.dev/unhealthy taint",
        ),
        # Diag's key with an effect diag never sets.
        (
            lambda n: n["spec"]["taints"].append(diag_taint("PreferNoSchedule")),
            "with effect NoSchedule or NoExecute only",
        ),
        # NoExecute without diag's NoSchedule taint beside it.
        (
            lambda n: n["spec"].update(
                taints=[t for t in n["spec"]["taints"] if t["key"] != TAINT_KEY]
                + [diag_taint("NoExecute")]
            ),
            "may set a NoExecute diag.dev/unhealthy taint only",
        ),
        # NoExecute with a record that does not say so.
        (
            lambda n: n["spec"]["taints"].append(diag_taint("NoExecute")),
            "may set a NoExecute diag.dev/unhealthy taint only",
        ),
    ],
)
def test_the_taint_a_token_may_not_set(change, why):
    old = node()
    new = tainted(old)
    change(new)
    allowed, messages = admit(policies()[NODE_POLICY], new, old, AGENT, "node-a")
    assert not allowed
    assert any(why in m for m in messages), messages


def test_no_execute_needs_a_hardware_fault_in_the_record():
    """A record claiming NoExecute for what is not a hardware fault (a failed precheck, a
    repeated culprit) does not let a token evict."""
    old = node()
    new = evicting(old, hardware_fault(), no_execute=True)
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a")[0]
    for reason in ("PrecheckFaulty", "RepeatedCulprit"):
        forged = with_record(new, reason=reason)
        allowed, messages = admit(policies()[NODE_POLICY], forged, old, AGENT, "node-a")
        assert not allowed
        assert any("naming a hardware fault" in m for m in messages), messages
    forged = with_record(new, effects=["NoSchedule"])
    assert not admit(policies()[NODE_POLICY], forged, old, AGENT, "node-a")[0]


@pytest.mark.parametrize("key", [RECORD_ANNOTATION, "diag.dev/notes"])
def test_a_200_kb_annotation_is_refused(key):
    old = node()
    new = tainted(old)
    new["metadata"]["annotations"][key] = "x" * 200_000
    allowed, messages = admit(policies()[NODE_POLICY], new, old, AGENT, "node-a")
    assert not allowed
    assert any(
        "at most 8192 characters" in m or "may change only the diag.dev/taint-record" in m
        for m in messages
    ), messages


def test_a_record_in_diag_s_form_but_oversized_is_refused():
    old = node()
    new = tainted(old)
    new = with_record(new, evidence=["XID 79 " + "x" * 9000])
    allowed, messages = admit(policies()[NODE_POLICY], new, old, AGENT, "node-a")
    assert not allowed
    assert any("at most 8192 characters" in m for m in messages), messages


def test_the_agent_s_record_stays_within_the_cap():
    """Evidence whose detail (from the node's logs and reports) is long: the agent cuts its
    record to the cap, and the policy takes it."""
    old = node()
    ev = [
        Evidence(Signal.GPU_XID, time.time() - i, xid=79, gpu=i % 8, detail="é" * 5000 + str(i))
        for i in range(40)
    ]
    ev.append(Evidence(Signal.NIC_NO_CARRIER, time.time(), detail="eth0 " * 4000))
    new = evicting(old, ev, no_execute=True)
    text = new["metadata"]["annotations"][RECORD_ANNOTATION]
    assert len(text) <= RECORD_MAX_CHARS
    assert TaintRecord.from_json(text).evidence  # the newest evidence stays
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a") == (True, [])


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"until": None}, "a finite expiry"),  # forever
        ({"until": "tomorrow"}, "a finite expiry"),
        ({"reason": "Whatever"}, "a known"),
        ({"extra": "x"}, "its JSON fields"),
    ],
)
def test_a_record_not_in_diag_s_form_is_refused(fields, why):
    old = node()
    new = with_record(tainted(old), **fields)
    allowed, messages = admit(policies()[NODE_POLICY], new, old, AGENT, "node-a")
    assert not allowed
    assert any(why in m for m in messages), messages


def test_an_infinite_expiry_is_refused():
    old = node()
    new = tainted(old)
    text = new["metadata"]["annotations"][RECORD_ANNOTATION]
    new["metadata"]["annotations"][RECORD_ANNOTATION] = re.sub(
        r'"until":[^}]*', '"until":Infinity', text
    )
    assert TaintRecord.from_json(new["metadata"]["annotations"][RECORD_ANNOTATION]).until == (
        float("inf")
    )
    assert not admit(policies()[NODE_POLICY], new, old, AGENT, "node-a")[0]


def test_diag_s_taint_without_its_record_is_refused():
    """The expiry sweep finds a taint's end in its record: a taint without one would stay."""
    old = node()
    new = tainted(old)
    del new["metadata"]["annotations"][RECORD_ANNOTATION]
    allowed, messages = admit(policies()[NODE_POLICY], new, old, AGENT, "node-a")
    assert not allowed
    assert any("only with its diag.dev/taint-record" in m for m in messages), messages


@pytest.mark.parametrize("expiry", [0.0, 30 * 24 * 3600.0])
def test_the_agent_s_expiry_is_bounded(expiry):
    """0 ("forever" before) and a month both give at most MAX_EXPIRY, which the policy takes."""
    old = node()
    now = time.time()
    plan = plan_taint(
        view_of(old), hardware_fault(), TaintPolicy(job="j", expiry=expiry), JobBudget(), now
    )
    assert plan.record is not None and plan.record.until == now + MAX_EXPIRY
    new = merge_patch(old, node_patch(plan, "7"))
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a") == (True, [])


def test_an_older_record_does_not_block_the_condition():
    """A node that carries a record of an earlier release (no expiry) still takes the agent's
    condition: the record rules hold for what a request changes."""
    old = with_record(tainted(node()), until=None)
    new = copy.deepcopy(old)
    new["status"]["conditions"].append(
        {"type": CONDITION_TYPE, "status": "True", "reason": "GpuXidCritical", "message": "x"}
    )
    assert admit(policies()[NODE_POLICY], new, old, AGENT, "node-a", sub="status") == (True, [])
