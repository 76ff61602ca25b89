"""The agent's node-health monitors: each turns its source into evidence, and the health watch
plans when the evidence says something new. Plain numbers for time in the pure parts; a real
veth (its peer in a network namespace of its own) for the NIC; real report files for the
precheck; NVML's events and counters as plain data for the GPU (the NVML path itself runs
where there is a driver)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netlab import netns_unavailable
from vethpair import Veth, veth_pair

from diag.agent.health.monitors import (
    LinkDown,
    LinkReading,
    NicMonitor,
    PrecheckMonitor,
    carrier_evidence,
)
from diag.agent.health.watch import HealthWatch, needs_plan, signature
from diag.agent.node.linkstate import NicState
from diag.agent.precheck.measurements import DeviceHealth, Severity
from diag.agent.precheck.report import NodeReport, Outcome, PrecheckReport
from diag.agent.taint.gpuhealth import (
    XID_CRITICAL_EVENT,
    EccReading,
    NvmlMonitor,
    XidEvent,
    ecc_evidence,
    xid_event,
    xid_evidence,
)
from diag.agent.taint.planner import (
    NO_EXECUTE,
    Action,
    Evidence,
    JobBudget,
    NodeView,
    Reason,
    Signal,
    TaintPolicy,
    plan_taint,
)

POLICY = TaintPolicy(job="llm")


# --- NIC carrier -------------------------------------------------------------------------------


def test_a_nic_counts_once_it_stayed_without_carrier_for_the_grace() -> None:
    down = LinkReading("ib0", True, False, "lowerlayerdown")
    up = LinkReading("ib0", True, True, "up")
    state, ev = carrier_evidence([down], {}, now=100.0, grace=10.0)
    assert ev == [] and state == {"ib0": LinkDown(100.0, "no carrier")}
    # Still down 9 s later: not yet. The operstate moved on; the line does not.
    state, ev = carrier_evidence([LinkReading("ib0", True, False, "down")], state, 109.0, 10.0)
    assert ev == []
    state, ev = carrier_evidence([down], state, 110.0, 10.0)
    assert [(e.signal, e.at, e.detail) for e in ev] == [
        (Signal.NIC_NO_CARRIER, 100.0, "ib0: no carrier")
    ]
    # The same fault on the next look: the same evidence, so the planner sees nothing new.
    _, again = carrier_evidence([down], state, 130.0, 10.0)
    assert again == ev
    # Back up: forgotten; a flap shorter than the grace never counts.
    state, ev = carrier_evidence([up], state, 131.0, 10.0)
    assert state == {} and ev == []
    state, _ = carrier_evidence([down], state, 140.0, 10.0)
    state, ev = carrier_evidence([up], state, 145.0, 10.0)
    assert ev == []


def test_a_nic_that_is_gone_counts_and_unknown_carrier_does_not() -> None:
    gone = LinkReading("eth1", present=False, carrier=None)
    unknown = LinkReading("eth2", True, None, "unknown")
    _, ev = carrier_evidence([gone, unknown], {}, 0.0, grace=0.0)
    assert [e.detail for e in ev] == ["eth1: gone"]


def test_the_planner_taints_for_it() -> None:
    _, ev = carrier_evidence([LinkReading("ib0", True, False, "down")], {}, 0.0, 0.0)
    plan = plan_taint(NodeView("n"), ev, POLICY, JobBudget(), 1.0)
    assert plan.action == Action.TAINT and plan.record.reason == Reason.NIC_NO_CARRIER
    assert "NIC without carrier (ib0: no carrier)" in plan.why


@pytest.fixture
def veth() -> Iterator[Veth]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with veth_pair("dh") as v:
        yield v


@pytest.mark.netns
def test_nic_monitor_reads_the_carrier_of_a_real_veth(veth: Veth) -> None:
    monitor = NicMonitor([veth.host], grace=0.0)
    monitor.start()
    (ev,) = monitor.poll(time.time())  # the peer is down: no carrier
    assert ev.signal == Signal.NIC_NO_CARRIER and ev.detail == f"{veth.host}: no carrier"
    assert veth.carrier() == "0" and ev.incident_path == f"/sys/class/net/{veth.host}"
    veth.peer_link("up")
    assert monitor.poll(time.time()) == ()
    veth.peer_link("down")
    assert [e.signal for e in monitor.poll(time.time())] == [Signal.NIC_NO_CARRIER]


def test_nic_monitor_with_an_interface_that_is_not_there(caplog) -> None:
    monitor = NicMonitor(["nosuch0"], grace=0.0)
    monitor.start()
    assert monitor.poll(0.0) == ()  # a name that never existed is a setting, not a fault
    assert "no interface nosuch0" in caplog.text and "--taint-watch-nics" in caplog.text


# --- precheck report ---------------------------------------------------------------------------


def _report(status: Severity, started: float, **node: Any) -> PrecheckReport:
    return PrecheckReport(
        job="llm",
        nnodes=1,
        reported_by=0,
        outcome=Outcome.FAULTY if status == Severity.FAULTY else Outcome.HEALTHY,
        faulty=(0,) if status == Severity.FAULTY else (),
        started_at=started,
        wall_seconds=3.0,
        nodes=(NodeReport(node=0, status=status, reason=node.pop("reason", ""), **node),),
    )


def _write(path: Path, report: PrecheckReport) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), default=str))
    tmp.replace(path)


def test_precheck_monitor_follows_the_report_file(tmp_path: Path, caplog) -> None:
    path = tmp_path / "precheck.json"
    monitor = PrecheckMonitor(path, "gpu-17")
    monitor.start()
    assert monitor.poll(0.0) == ()  # not written yet
    faulty = _report(
        Severity.FAULTY,
        1000.0,
        reason="device: GPU 3 uncorrected ECC",
        devices=(DeviceHealth(index=3, name="H100", ecc_uncorrected=2, xid_errors=(79,)),),
        nic=NicState("ib0", operstate="up", carrier=True),
    )
    _write(path, faulty)
    ev = monitor.poll(0.0)
    assert sorted(e.signal for e in ev) == sorted(
        [Signal.PRECHECK_FAULTY, Signal.GPU_ECC, Signal.GPU_XID]
    )
    assert all(e.at == 1003.0 and e.incident_path == str(path) for e in ev)
    _write(path, _report(Severity.HEALTHY, 2000.0))
    assert [(e.signal, e.at) for e in monitor.poll(0.0)] == [(Signal.PRECHECK_HEALTHY, 2003.0)]
    path.write_text("{not json")
    assert monitor.poll(0.0) == ()
    assert "--taint-precheck-report" in caplog.text and "not a diag precheck report" in caplog.text
    path.unlink()
    assert monitor.poll(0.0) == ()


# --- GPU: NVML's answers as plain data ---------------------------------------------------------


@dataclass
class RawEvent:
    """The fields of NVML's `c_nvmlEventData_t` that the decoder reads."""

    device: Any
    eventType: int  # NVML's field names
    eventData: int


def test_xid_events_decode_into_evidence() -> None:
    def index_of(device: Any) -> int:
        if device == "lost":
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return {"h0": 0, "h3": 3}[device]

    names = {0: "NVIDIA H100 80GB HBM3", 3: "NVIDIA H100 80GB HBM3"}
    events = [
        xid_event(RawEvent("h3", XID_CRITICAL_EVENT, 79), index_of, names, 50.0),
        xid_event(RawEvent("h0", XID_CRITICAL_EVENT, 13), index_of, names, 60.0),
        xid_event(RawEvent("lost", XID_CRITICAL_EVENT, 48), index_of, names, 70.0),
        xid_event(RawEvent("h0", 0x1, 0), index_of, names, 80.0),  # a single-bit ECC event
    ]
    assert events[:3] == [
        XidEvent(3, 79, 50.0, "NVIDIA H100 80GB HBM3"),
        XidEvent(0, 13, 60.0, "NVIDIA H100 80GB HBM3"),
        XidEvent(-1, 48, 70.0, ""),
    ]
    assert events[3] is None
    ev = xid_evidence([e for e in events if e], now=100.0, memory=45.0)
    assert [(e.xid, e.gpu) for e in ev] == [(13, 0), (48, None)]  # XID 79 is older than 45 s
    ev = xid_evidence([e for e in events if e], now=100.0, memory=0.0)
    plan = plan_taint(NodeView("n"), ev, TaintPolicy(no_execute=True), JobBudget(), 100.0)
    # XID 13 is the application's; 79 and 48 are the hardware's: NoExecute, as configured.
    assert plan.record.reason == Reason.GPU_XID and NO_EXECUTE in plan.record.effects
    assert plan.record.evidence == ("XID 48 (nvml)", "XID 79 on GPU 3 (NVIDIA H100 80GB HBM3)")


def test_ecc_readings_decode_into_evidence() -> None:
    readings = [EccReading(0, 0, "H100"), EccReading(1, None, "H100"), EccReading(2, 4, "H100")]
    ev = ecc_evidence(readings, at=10.0)
    assert [(e.signal, e.gpu, e.count) for e in ev] == [(Signal.GPU_ECC, 2, 4)]
    plan = plan_taint(NodeView("n"), ev, POLICY, JobBudget(), 10.0)
    assert plan.record.reason == Reason.GPU_ECC
    assert plan.why == "GPU 2: 4 uncorrected ECC errors (GPU 2 H100)"


def test_the_xid_event_bit_is_nvml_s() -> None:
    pynvml = pytest.importorskip("pynvml")
    assert pynvml.nvmlEventTypeXidCriticalError == XID_CRITICAL_EVENT


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


def test_nvml_monitor_without_a_driver_starts_nothing() -> None:
    if _has_gpu():
        pytest.skip("a GPU is here: test_nvml_monitor_on_a_gpu runs instead")
    monitor = NvmlMonitor()
    monitor.start()
    try:
        assert not monitor.running and "no NVIDIA driver" in (monitor.note or "")
        assert monitor.poll(time.time()) == ()
    finally:
        monitor.close()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_nvml_monitor_on_a_gpu() -> None:
    if not _has_gpu():
        pytest.skip("no NVIDIA GPU")
    monitor = NvmlMonitor(ecc_interval=0.5)
    monitor.start()
    try:
        assert monitor.running and monitor.note is None
        time.sleep(2.5)  # a few XID waits and ECC reads on the thread
        readings = monitor.readings()
        assert readings and all(r.uncorrected is None or r.uncorrected >= 0 for r in readings)
        # A healthy GPU gives no evidence; one with errors gives exactly its counts.
        ev = monitor.poll(time.time())
        assert [e.count for e in ev if e.signal == Signal.GPU_ECC] == [
            r.uncorrected for r in readings if r.uncorrected
        ]
    finally:
        monitor.close()
    assert not monitor.running


# --- the health watch --------------------------------------------------------------------------


def test_signature_and_when_to_plan() -> None:
    nic = Evidence(Signal.NIC_NO_CARRIER, 5.0, "ib0: no carrier")
    clean = Evidence(Signal.PRECHECK_HEALTHY, 9.0, "precheck passed")
    app_xid = Evidence(Signal.GPU_XID, 6.0, "H100", gpu=0, xid=13)
    assert signature([app_xid], POLICY, 10.0) == frozenset()  # the application's XID says nothing
    one = signature([nic], POLICY, 10.0)
    assert one == {"NIC without carrier (ib0: no carrier)"}
    assert needs_plan(one, frozenset())
    assert not needs_plan(one, one)
    assert not needs_plan(frozenset(), one)  # a fault that went away: the taint stays
    assert needs_plan(signature([nic, clean], POLICY, 10.0), one)


def test_health_watch_plans_when_something_is_new(tmp_path: Path) -> None:
    path = tmp_path / "precheck.json"
    planned: list[tuple[Evidence, ...]] = []
    results = [False, True, True]

    def plan(evidence) -> bool:
        planned.append(tuple(evidence))
        return results[len(planned) - 1]

    watch = HealthWatch([PrecheckMonitor(path, "n")], POLICY, interval=1.0, clock=lambda: 50.0)
    assert not watch.step(plan) and planned == []  # nothing to say
    _write(path, _report(Severity.FAULTY, 10.0, reason="nic: no carrier on ib0"))
    assert not watch.step(plan)  # the plan failed (say the API server was away) ...
    assert watch.step(plan)  # ... so the next look plans again
    assert not watch.step(plan) and len(planned) == 2  # nothing new
    assert [e.signal for e in watch.current()] == [Signal.PRECHECK_FAULTY]
    _write(path, _report(Severity.HEALTHY, 20.0))
    assert watch.step(plan) and [e.signal for e in planned[-1]] == [Signal.PRECHECK_HEALTHY]


# --- configuration -----------------------------------------------------------------------------


def test_health_options_flags_over_env_over_file(tmp_path: Path) -> None:
    import argparse

    from diag.agent.config import agentconfig as agent_config
    from diag.formats.exitcodes import UsageError

    conf = tmp_path / "agent.toml"
    conf.write_text(
        '[taint]\nwatch_nics = ["ib0", "ib1"]\nnic_grace = 30\nprecheck_report = "/run/pc.json"\n'
    )
    parser = argparse.ArgumentParser()
    agent_config.add_arguments(parser)

    def load(*argv: str, **env: str):  # type: ignore[no-untyped-def]
        args = parser.parse_args(["--config", str(conf), "--node", "n", *argv])
        return agent_config.load(args, env=env).taint.health

    h = load()
    assert (h.nics, h.nic_grace, h.precheck_report, h.gpu, h.interval) == (
        ("ib0", "ib1"),
        30.0,
        Path("/run/pc.json"),
        True,
        10.0,
    )
    h = load("--taint-nic-grace", "5", DIAG_TAINT_NIC_GRACE="7", DIAG_TAINT_WATCH_NICS="eth0")
    assert (h.nics, h.nic_grace) == (("eth0",), 5.0)
    assert load("--taint-gpu-watch", "false").gpu is False
    for argv, problem in (
        (("--taint-watch-nics", "eth0,/sys/x"), "--taint-watch-nics: not an interface name"),
        (("--taint-health-interval", "0"), "--taint-health-interval: must be > 0"),
        (("--taint-gpu-watch", "maybe"), "--taint-gpu-watch: expected true or false"),
    ):
        with pytest.raises(UsageError, match=problem):
            load(*argv)
