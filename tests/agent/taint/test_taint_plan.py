"""Table tests of the taint planner (diag/agent/taint/planner.py): plain numbers for time."""

from __future__ import annotations

import pytest

from diag.agent.taint.planner import (
    CONDITION_TYPE,
    NO_EXECUTE,
    NO_SCHEDULE,
    TAINT_KEY,
    Action,
    Condition,
    Evidence,
    JobBudget,
    NodeView,
    Reason,
    Signal,
    Taint,
    TaintPolicy,
    TaintRecord,
    plan_taint,
    plan_untaint,
)

NOW = 100_000.0
POLICY = TaintPolicy(job="llm", culprit_threshold=3, culprit_window=3600, expiry=7200)
OTHER = Taint("nvidia.com/gpu", "NoSchedule", "present")


def xid(code: int, gpu: int = 0, at: float = NOW) -> Evidence:
    return Evidence(
        Signal.GPU_XID, at, xid=code, gpu=gpu, incident_id="inc-1", incident_path="/t/a"
    )


def culprit(n: int, at: float = NOW, spacing: float = 60) -> list[Evidence]:
    return [
        Evidence(Signal.CULPRIT, at - i * spacing, incident_id=f"inc-{i}", incident_path=f"/t/{i}")
        for i in range(n)
    ]


def tainted(reason: Reason = Reason.GPU_XID, since: float = NOW - 100, until: float | None = None):
    rec = TaintRecord(
        reason=reason,
        message="XID 79 on GPU 0",
        since=since,
        until=until,
        job="llm",
        evidence=("XID 79 on GPU 0",),
    )
    return NodeView(
        "n1",
        taints=(OTHER, Taint(TAINT_KEY, NO_SCHEDULE, reason.value)),
        conditions=(Condition(CONDITION_TYPE, "True", reason.value, "x", since, since),),
        record=rec,
    )


@pytest.mark.parametrize(
    "evidence, action, reason",
    [
        ([], Action.NONE, None),
        ([xid(13)], Action.NONE, None),  # application-caused XIDs never taint
        ([xid(31), xid(43), xid(45), xid(68)], Action.NONE, None),
        ([xid(79)], Action.TAINT, Reason.GPU_XID),
        ([xid(999)], Action.TAINT, Reason.GPU_XID),  # unknown XIDs count as critical
        ([Evidence(Signal.GPU_ECC, NOW, count=0)], Action.NONE, None),
        ([Evidence(Signal.GPU_ECC, NOW, count=2, gpu=1)], Action.TAINT, Reason.GPU_ECC),
        ([Evidence(Signal.NIC_NO_CARRIER, NOW, "eth0")], Action.TAINT, Reason.NIC_NO_CARRIER),
        ([Evidence(Signal.PRECHECK_FAULTY, NOW, "r")], Action.TAINT, Reason.PRECHECK_FAULTY),
        ([Evidence(Signal.PRECHECK_HEALTHY, NOW)], Action.NONE, None),
        (culprit(2), Action.NONE, None),
        (culprit(3), Action.TAINT, Reason.REPEATED_CULPRIT),
        (culprit(3, spacing=2000), Action.NONE, None),  # two of them outside the window
        (culprit(1) * 3, Action.NONE, None),  # one incident seen three times is one incident
        # hardware evidence leads, whatever the order it came in
        (
            [
                Evidence(Signal.PRECHECK_FAULTY, NOW + 5, "r"),
                Evidence(Signal.GPU_ECC, NOW, count=1),
            ],
            Action.TAINT,
            Reason.GPU_ECC,
        ),
    ],
)
def test_what_taints(evidence, action, reason):
    node = NodeView("n1", taints=(OTHER,))
    plan = plan_taint(node, evidence, POLICY, JobBudget(), NOW)
    assert plan.action == action, plan.why
    if action == Action.TAINT:
        assert plan.added == (Taint(TAINT_KEY, NO_SCHEDULE, reason.value),)
        assert plan.taints == (OTHER, *plan.added)  # the node's other taints stay
        assert plan.condition is not None and plan.condition.status == "True"
        assert plan.condition.reason == reason.value
        assert plan.record is not None and plan.record.reason == reason
        assert plan.record.until == NOW + 7200 and plan.record.job == "llm"
        assert plan.event is not None and plan.event.type == "Warning"
        assert reason.value in plan.event.message
        assert plan.claims_budget
    else:
        assert plan.taints == (OTHER,) and not plan.added and plan.event is None


def test_event_carries_incident_id_reason_and_path():
    plan = plan_taint(NodeView("n1"), [xid(79)], POLICY, JobBudget(), NOW)
    assert plan.event is not None
    assert plan.event.incident_id == "inc-1" and plan.event.incident_path == "/t/a"
    assert "incident inc-1" in plan.event.message and "/t/a" in plan.event.message
    assert "XID 79 on GPU 0" in plan.event.message


def test_repeated_culprit_lists_incidents():
    plan = plan_taint(NodeView("n1"), culprit(3), POLICY, JobBudget(), NOW)
    assert "culprit of 3 incidents in 1 h (inc-0, inc-1, inc-2)" in plan.why
    assert plan.record is not None and plan.record.incident_id == "inc-0"  # the newest


@pytest.mark.parametrize(
    "no_execute, evidence, effects",
    [
        (False, [xid(79)], (NO_SCHEDULE,)),
        (True, [xid(79)], (NO_SCHEDULE, NO_EXECUTE)),  # confirmed hardware fault
        (True, [xid(999)], (NO_SCHEDULE,)),  # critical but not known hardware
        (True, [Evidence(Signal.GPU_ECC, NOW, count=1)], (NO_SCHEDULE, NO_EXECUTE)),
        (True, [Evidence(Signal.NIC_NO_CARRIER, NOW)], (NO_SCHEDULE, NO_EXECUTE)),
        (True, [Evidence(Signal.PRECHECK_FAULTY, NOW)], (NO_SCHEDULE,)),
        (True, culprit(3), (NO_SCHEDULE,)),
    ],
)
def test_no_execute_only_where_configured_and_for_hardware(no_execute, evidence, effects):
    policy = TaintPolicy(no_execute=no_execute)
    plan = plan_taint(NodeView("n1"), evidence, policy, JobBudget(), NOW)
    assert tuple(t.effect for t in plan.added) == effects


@pytest.mark.parametrize(
    "budget, blocked_by",
    [
        (JobBudget(tainted_nodes=("a",)), ""),  # cap 2: one other node is fine
        (JobBudget(tainted_nodes=("a", "b")), "job-cap"),
        (JobBudget(tainted_nodes=("a", "n1")), ""),  # this node's own slot is not another's
        (JobBudget(recent_taints=(NOW - 100,)), "rate-limit"),
        (JobBudget(recent_taints=(NOW - 700,)), ""),  # outside the 600 s window
    ],
)
def test_cap_and_rate_limit(budget, blocked_by):
    policy = TaintPolicy(job="llm", job_cap=2, rate_count=1, rate_window=600)
    plan = plan_taint(NodeView("n1", taints=(OTHER,)), [xid(79)], policy, budget, NOW)
    if blocked_by:
        assert plan.action == Action.BLOCKED and plan.blocked_by == blocked_by
        assert plan.taints == (OTHER,) and not plan.added and not plan.claims_budget
        # the evidence is still on the node, as a condition and an Event
        assert plan.condition is not None and plan.condition.status == "True"
        assert plan.event is not None and blocked_by in plan.event.message
    else:
        assert plan.action == Action.TAINT


def test_already_tainted_same_evidence_is_no_change():
    plan = plan_taint(tainted(), [xid(79)], POLICY, JobBudget(), NOW)
    assert plan.action == Action.NONE and not plan.changes_node


def test_already_tainted_new_evidence_updates_and_keeps_since():
    ecc = Evidence(Signal.GPU_ECC, NOW, count=4, gpu=2, incident_id="inc-9")
    plan = plan_taint(tainted(), [xid(79), ecc], POLICY, JobBudget(), NOW)
    assert plan.action == Action.UPDATE and not plan.added
    assert plan.record is not None and plan.record.since == NOW - 100
    assert plan.record.reason == Reason.GPU_ECC and plan.record.until == NOW + 7200
    assert plan.condition is not None and plan.condition.last_transition == NOW - 100
    assert not plan.claims_budget  # a tainted node does not take another slot
    # what the record held stays in it, the new line first
    assert plan.record.evidence == ("GPU 2: 4 uncorrected ECC errors", "XID 79 on GPU 0")


def test_update_keeps_the_weightier_reason_and_the_job():
    node = tainted(Reason.GPU_XID)
    plan = plan_taint(node, culprit(3), TaintPolicy(job="other"), JobBudget(), NOW)
    assert plan.action == Action.UPDATE
    assert plan.record.reason == Reason.GPU_XID and plan.record.job == "llm"
    assert plan.record.evidence[-1] == "XID 79 on GPU 0"


def test_update_adds_no_execute_when_hardware_evidence_arrives():
    policy = TaintPolicy(no_execute=True)
    plan = plan_taint(tainted(Reason.PRECHECK_FAULTY), [xid(79)], policy, JobBudget(), NOW)
    assert plan.action == Action.UPDATE
    assert [t.effect for t in plan.added] == [NO_EXECUTE]


def test_a_tainted_node_is_not_blocked_by_the_cap():
    full = JobBudget(tainted_nodes=("a", "b", "c"), recent_taints=(NOW,))
    ecc = Evidence(Signal.GPU_ECC, NOW, count=1)
    assert plan_taint(tainted(), [ecc], POLICY, full, NOW).action == Action.UPDATE


@pytest.mark.parametrize(
    "until, evidence, action, reason",
    [
        (None, [], Action.NONE, None),
        (NOW + 10, [], Action.NONE, None),
        (NOW, [], Action.UNTAINT, "Expired"),
        (NOW - 1, [], Action.UNTAINT, "Expired"),
        (None, [Evidence(Signal.PRECHECK_HEALTHY, NOW - 50)], Action.UNTAINT, "PrecheckClean"),
        # a clean precheck from before the taint does not clear it
        (None, [Evidence(Signal.PRECHECK_HEALTHY, NOW - 150)], Action.NONE, None),
        # evidence that still taints wins over the expiry
        (NOW - 1, [xid(79)], Action.NONE, None),
    ],
)
def test_what_untaints(until, evidence, action, reason):
    node = tainted(until=until)
    plan = plan_taint(node, evidence, POLICY, JobBudget(), NOW)
    assert plan.action == action, plan.why
    if action == Action.UNTAINT:
        assert plan.taints == (OTHER,) and plan.removed == node.ours
        assert plan.clear_record and plan.record is None
        assert plan.condition is not None and plan.condition.status == "False"
        assert plan.condition.reason == reason and plan.condition.last_transition == NOW
        assert plan.event is not None and plan.event.type == "Normal"


def test_manual_untaint_keeps_other_taints():
    node = tainted()
    plan = plan_untaint(node, NOW, "diag untaint by admin")
    assert plan.action == Action.UNTAINT and plan.taints == (OTHER,)
    assert plan.condition is not None and plan.condition.reason == "ManualUntaint"
    assert plan_untaint(NodeView("n1", taints=(OTHER,)), NOW).action == Action.NONE


def test_untaint_of_a_taint_without_record():
    node = NodeView("n1", taints=(Taint(TAINT_KEY, NO_SCHEDULE, "GpuXidCritical"),))
    assert plan_taint(node, [], POLICY, JobBudget(), NOW).action == Action.NONE
    plan = plan_untaint(node, NOW)
    assert plan.action == Action.UNTAINT and plan.taints == () and not plan.clear_record


def test_record_round_trip_and_damage():
    rec = tainted(until=5.0).record
    assert rec is not None and TaintRecord.from_json(rec.to_json()) == rec
    with pytest.raises(ValueError, match="taint-record"):
        TaintRecord.from_json('{"reason": "Nope"}')


def test_describe_names_every_change():
    text = plan_taint(NodeView("n1"), [xid(79)], POLICY, JobBudget(), NOW).describe()
    assert "node n1: taint" in text and f"+ taint {TAINT_KEY}=GpuXidCritical:NoSchedule" in text
    assert "condition DiagUnhealthy=True" in text and "event Warning DiagTainted" in text


def test_condition_left_by_a_blocked_plan_is_cleared_by_a_clean_precheck():
    cond = Condition(CONDITION_TYPE, "True", "GpuXidCritical", "XID 79; not tainted: job-cap")
    node = NodeView("n1", conditions=(cond,))
    assert plan_taint(node, [], POLICY, JobBudget(), NOW).action == Action.NONE
    clean = [Evidence(Signal.PRECHECK_HEALTHY, NOW)]
    plan = plan_taint(node, clean, POLICY, JobBudget(), NOW)
    assert plan.action == Action.UNTAINT and plan.condition.status == "False"
    assert not plan.removed and not plan.clear_record
