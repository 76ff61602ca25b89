"""The expiry account's admission policy (deploy/k8s/expiry/admission-policy.yaml), evaluated by a
real CEL evaluator (tests/support/cluster/celadmission.py) against what `diag untaint --expired` really sends: the
node after the JSON merge patch `diag/agent/taint/kube.py` builds from the expiry plan, the node's status
after its condition patch, and its Event. Whatever else the account tries is refused: RBAC lets
it patch every node, the policy lets it only take diag's taint off."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from celadmission import admit, load_policies, merge_patch, status_merge
from repo import ROOT

from diag.agent.taint.kube import event_body, node_patch, status_patch
from diag.agent.taint.planner import (
    CONDITION_TYPE,
    MAX_EXPIRY,
    RECORD_ANNOTATION,
    TAINT_KEY,
    Condition,
    Evidence,
    JobBudget,
    NodeView,
    Signal,
    Taint,
    TaintPolicy,
    TaintRecord,
    plan_expiry,
    plan_taint,
)

POLICY_FILE = ROOT / "deploy/k8s/expiry/admission-policy.yaml"
EXPIRY = "system:serviceaccount:diag-system:diag-taint-expiry"
NODE_POLICY = "diag-taint-expiry-removes-only"
EVENT_POLICY = "diag-taint-expiry-events"
T0 = 1_800_000_000.0
POLICY = TaintPolicy(job="llm", expiry=3600)


def policies() -> dict[str, dict]:
    return load_policies(POLICY_FILE)


def bare_node() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": "gpu-17",
            "resourceVersion": "7",
            "labels": {"kubernetes.io/hostname": "gpu-17"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
    }


def view_of(n: dict) -> NodeView:
    """What `kube.read_node` makes of the node."""
    taints = tuple(
        Taint(t["key"], t["effect"], t.get("value", "")) for t in n["spec"].get("taints", [])
    )
    conditions = tuple(
        Condition(c["type"], c["status"], c.get("reason", ""), c.get("message", ""))
        for c in n["status"]["conditions"]
    )
    raw = n["metadata"]["annotations"].get(RECORD_ANNOTATION)
    record = TaintRecord.from_json(raw) if raw else None
    return NodeView(n["metadata"]["name"], taints, conditions, record)


def apply(n: dict, plan) -> dict:  # type: ignore[no-untyped-def]
    """The node after both of the plan's patches, as the API server stores it."""
    out = merge_patch(n, node_patch(plan, n["metadata"]["resourceVersion"]))
    status = status_patch(plan)
    return status_merge(out, status) if status is not None else out


def tainted_node() -> dict:
    """The node as its agent left it: diag's taint (NoSchedule and NoExecute), record and
    condition, from a real plan."""
    ev = [Evidence(Signal.GPU_XID, T0, xid=79, gpu=3, incident_id="i", incident_path="/t/i")]
    policy = TaintPolicy(job="llm", expiry=3600, no_execute=True)
    plan = plan_taint(view_of(bare_node()), ev, policy, JobBudget(), T0)
    return apply(bare_node(), plan)


def expired() -> tuple[dict, dict, Any]:
    """(before, after, plan) of the expiry sweep an hour and a bit later."""
    old = tainted_node()
    plan = plan_expiry(view_of(old), POLICY, T0 + 3700)
    return old, apply(old, plan), plan


def test_the_sweep_may_take_diag_s_taint_off() -> None:
    old, new, plan = expired()
    assert plan.action.value == "untaint" and plan.condition.reason == "Expired"
    assert [t["key"] for t in new["spec"]["taints"]] == ["nvidia.com/gpu"]
    assert RECORD_ANNOTATION not in new["metadata"]["annotations"]
    # The two requests it makes: the node (taints and annotation), then its status.
    main = merge_patch(old, node_patch(plan, "8"))
    assert admit(policies()[NODE_POLICY], main, old, EXPIRY, None) == (True, [])
    assert admit(policies()[NODE_POLICY], new, main, EXPIRY, None, sub="status") == (True, [])
    (cond,) = [c for c in new["status"]["conditions"] if c["type"] == CONDITION_TYPE]
    assert cond["status"] == "False"


def test_a_taint_not_yet_expired_is_left_alone() -> None:
    plan = plan_expiry(view_of(tainted_node()), POLICY, T0 + 60)
    assert plan.action.value == "none" and not plan.changes_node  # nothing is sent


def test_its_event_is_allowed() -> None:
    _, _, plan = expired()
    ev = event_body("gpu-17", "uid-1", plan.event, "diag-system", 1)
    assert ev["reason"] == "DiagUntainted"
    assert admit(policies()[EVENT_POLICY], ev, None, EXPIRY, None) == (True, [])


def _drop_ours(n: dict) -> None:
    n["spec"]["taints"] = [t for t in n["spec"]["taints"] if t["key"] != TAINT_KEY]


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda n: n["spec"].update(taints=[]), "may remove only the diag.dev/unhealthy taint"),
        (
            lambda n: n["spec"]["taints"].append({"key": "example.com/x", "effect": "NoSchedule"}),
            "may remove only the diag.dev/unhealthy taint",
        ),
        (
            lambda n: n["spec"]["taints"][0].update(value="absent"),
            "may remove only the diag.dev/unhealthy taint",
        ),
        (lambda n: n["metadata"]["labels"].update(gpu="drained"), "may not change node labels"),
        (
            lambda n: n["metadata"]["annotations"].pop("node.alpha.kubernetes.io/ttl"),
            "may remove only the diag.dev/taint-record annotation",
        ),
        (
            lambda n: n["metadata"]["annotations"].update({"diag.dev/incident-id": "x"}),
            "may remove only the diag.dev/taint-record annotation",
        ),
        (lambda n: n["spec"].update(unschedulable=True), "may not cordon"),
        (
            lambda n: n["status"]["conditions"][0].update(status="False"),
            "may change only the DiagUnhealthy condition",
        ),
    ],
)
def test_what_the_sweep_may_not_do(change, why) -> None:  # type: ignore[no-untyped-def]
    _, new, _ = expired()
    old = copy.deepcopy(new)
    change(new)
    allowed, messages = admit(policies()[NODE_POLICY], new, old, EXPIRY, None)
    assert not allowed and any(why in m for m in messages), messages


def test_it_may_not_taint_or_write_a_record() -> None:
    """What the agent sends to taint a node is refused to the expiry account: the taint, the
    record and a True condition, each on its own."""
    old = bare_node()
    ev = [Evidence(Signal.NIC_NO_CARRIER, T0, "ib0: no carrier")]
    plan = plan_taint(view_of(old), ev, POLICY, JobBudget(), T0)
    main = merge_patch(old, node_patch(plan, "7"))
    allowed, messages = admit(policies()[NODE_POLICY], main, old, EXPIRY, None)
    assert not allowed
    assert any("not add them" in m for m in messages), messages
    assert any("diag.dev/taint-record" in m for m in messages), messages
    status = status_merge(old, status_patch(plan))
    allowed, messages = admit(policies()[NODE_POLICY], status, old, EXPIRY, None, sub="status")
    assert not allowed and messages == [
        "diag-taint-expiry may set the DiagUnhealthy condition to False only"
    ]
    # Nor may it bring back a taint that was taken off, or keep a record fresh.
    _, cleared, _ = expired()
    again = copy.deepcopy(cleared)
    again["spec"]["taints"].append({"key": TAINT_KEY, "effect": "NoSchedule"})
    assert not admit(policies()[NODE_POLICY], again, cleared, EXPIRY, None)[0]
    old = tainted_node()
    fresh = copy.deepcopy(old)
    fresh["metadata"]["annotations"][RECORD_ANNOTATION] = "{}"
    assert not admit(policies()[NODE_POLICY], fresh, old, EXPIRY, None)[0]


@pytest.mark.parametrize(
    "reason, kind, type_",
    [("DiagTainted", "Node", "Warning"), ("DiagUntainted", "Pod", "Normal")],
)
def test_other_events_are_refused(reason: str, kind: str, type_: str) -> None:
    _, _, plan = expired()
    ev = event_body("gpu-17", "uid-1", plan.event, "diag-system", 1)
    ev.update(reason=reason, type=type_)
    ev["involvedObject"]["kind"] = kind
    assert not admit(policies()[EVENT_POLICY], ev, None, EXPIRY, None)[0]


def test_only_the_expiry_account_is_matched() -> None:
    old = bare_node()
    new = copy.deepcopy(old)
    new["spec"]["unschedulable"] = True
    for user in ("admin", "system:node:gpu-17", "system:serviceaccount:training:diag-agent"):
        assert admit(policies()[NODE_POLICY], new, old, user, None) == (True, [])
    # The account the CronJob runs as is matched, in whatever namespace it is installed.
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/expiry/expiry.yaml").read_text())]
    (cron,) = [d for d in docs if d and d["kind"] == "CronJob"]
    account = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["serviceAccountName"]
    for ns in (cron["metadata"]["namespace"], "ops"):
        user = f"system:serviceaccount:{ns}:{account}"
        assert not admit(policies()[NODE_POLICY], new, old, user, None)[0]


@pytest.mark.parametrize(
    "until", [None, T0 + MAX_EXPIRY + 3600, 4_000_000_000.0], ids=["never", "past-max", "far"]
)
def test_a_taint_that_would_outlast_the_bound_is_swept(until: float | None) -> None:
    """Admission has no clock: a record that expires never, or later than MAX_EXPIRY from now
    (a token writing its own), is removed by the sweep at once, which its policy admits."""
    old = tainted_node()
    rec = json.loads(old["metadata"]["annotations"][RECORD_ANNOTATION])
    rec["until"] = until
    old["metadata"]["annotations"][RECORD_ANNOTATION] = json.dumps(rec)
    plan = plan_expiry(view_of(old), POLICY, T0 + 60)
    assert plan.action.value == "untaint" and plan.condition.reason == "Expired"
    main = merge_patch(old, node_patch(plan, "8"))
    assert TAINT_KEY not in {t["key"] for t in main["spec"]["taints"]}
    assert admit(policies()[NODE_POLICY], main, old, EXPIRY, None) == (True, [])
    # One within the bound stays until it expires.
    rec["until"] = T0 + MAX_EXPIRY
    old["metadata"]["annotations"][RECORD_ANNOTATION] = json.dumps(rec)
    assert plan_expiry(view_of(old), POLICY, T0 + 60).action.value == "none"
