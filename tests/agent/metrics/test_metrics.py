"""The agent's metrics: pure parts with plain numbers, collectors through a real registry."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from diag.agent.config import agentconfig as config_mod
from diag.agent.detect.hang import Policy, Verdict, VerdictKind, WatchState, decide
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.detect.timeouts import TimeoutPolicy
from diag.agent.evidence.collection import EvidenceResult, IncidentReport
from diag.agent.metrics import families as f
from diag.agent.metrics.checkpoint import CheckpointMetrics
from diag.agent.metrics.collectives import bus_bandwidth, bus_factor, new_completions, op_kind
from diag.agent.metrics.exporter import AgentMetrics
from diag.agent.metrics.exposition import TextWriter, render_text
from diag.agent.metrics.gpu import GpuReading, gpu_families
from diag.agent.metrics.host import HostCollector
from diag.agent.metrics.prechecktext import PrecheckFileCollector
from diag.agent.metrics.rankstate import rank_metrics
from diag.agent.metrics.xputimer import XpuTimerIdentity, render
from diag.formats.exitcodes import UsageError
from diag.formats.records import OpCode, OpState

NOW = 1000.0
TIMEOUTS = TimeoutPolicy(ceiling=60.0, floor=2.0, factor=5.0, warmup_steps=2)


def done(seq: int, t0: float, t1: float, nbytes: int = 1 << 20, code=OpCode.ALL_REDUCE) -> OpView:
    return OpView("0", seq, code, OpState.COMPLETED, nbytes, t0, t1)


def snap(
    r: int,
    *,
    last: float = NOW - 0.1,
    pending: tuple[OpView, ...] = (),
    liveness: Liveness = Liveness.RUNNING,
    durations: tuple[float, ...] = (0.4, 0.5),
    step: int = 10,
) -> RankSnapshot:
    return RankSnapshot(
        rank=r,
        local_rank=r % 8,
        pid=100 + r,
        node="n1",
        liveness=liveness,
        started_at=0.0,
        last_activity=last,
        step=step,
        pending=pending,
        step_durations=durations,
        cpu_busy=0.25,
    )


def observation(*ranks: RankSnapshot, recent: dict | None = None, now: float = NOW) -> Observation:
    world = max(r.rank for r in ranks) + 1 if ranks else 0
    return Observation(
        now=now,
        ranks=tuple(ranks),
        groups={"0": tuple(range(world))},
        world_size=world,
        recent_ops=recent or {},
        job="train",
    )


# -- collectives ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, n, factor",
    [
        (OpCode.ALL_REDUCE, 8, 1.75),
        (OpCode.ALL_REDUCE_COALESCED, 2, 1.0),
        (OpCode.ALL_REDUCE, 1, 0.0),
        (OpCode.ALL_GATHER_BASE, 4, 0.75),
        (OpCode.REDUCE_SCATTER, 2, 0.5),
        (OpCode.ALL_TO_ALL, 8, 0.875),
        (OpCode.BROADCAST, 8, 1.0),
        (OpCode.REDUCE, 8, 1.0),
        (OpCode.SEND, 2, 1.0),
    ],
)
def test_bus_factor_follows_nccl_tests(code: OpCode, n: int, factor: float) -> None:
    assert bus_factor(code, n) == pytest.approx(factor)


@pytest.mark.parametrize(
    "code, kind",
    [
        (OpCode.ALL_GATHER_COALESCED, "all_gather"),
        (OpCode.REDUCE_SCATTER_BASE, "reduce_scatter"),
        (OpCode.MONITORED_BARRIER, "barrier"),
        (OpCode.RECV_ANYSOURCE, "recv"),
        (OpCode.UNKNOWN, "other"),
    ],
)
def test_op_variants_share_a_kind(code: OpCode, kind: str) -> None:
    assert op_kind(code) == kind


def test_bus_bandwidth_is_bus_bytes_over_time() -> None:
    mb = 1_000_000
    recent = {
        0: (
            done(1, 0.0, 0.1, 1 * mb),
            done(2, 1.0, 1.1, 3 * mb),
            done(3, 2.0, 2.5, 0, OpCode.BARRIER),  # no bytes: not counted
            done(4, 3.0, 3.2, 2 * mb, OpCode.ALL_GATHER),
        ),
        1: (done(1, 0.0, 0.0, mb),),  # no measurable duration
    }
    out = bus_bandwidth(recent, {"0": (0, 1, 2, 3)})
    assert [(b.rank, b.kind, b.ops) for b in out] == [(0, "all_gather", 1), (0, "all_reduce", 2)]
    by_kind = {b.kind: b.bytes_per_second for b in out}
    assert by_kind["all_reduce"] == pytest.approx(4 * mb * 1.5 / 0.2)
    assert by_kind["all_gather"] == pytest.approx(2 * mb * 0.75 / 0.2)


def test_new_completions_finds_the_last_seen_op_by_identity() -> None:
    a, b, c = done(1, 0, 1), done(2, 1, 2), done(3, 2, 3)
    same_as_b = done(2, 1, 2)  # equal, but another object: a restarted rank's op
    assert list(new_completions(None, (a, b, c))) == [a, b, c]
    assert list(new_completions(b, (a, b, c))) == [c]
    assert list(new_completions(c, (a, b, c))) == []
    assert list(new_completions(same_as_b, (a, b, c))) == [a, b, c]


# -- per-rank state -------------------------------------------------------------------------------


def test_rank_metrics_of_healthy_ranks() -> None:
    o = observation(
        snap(0),
        snap(1, pending=(OpView("0", 5, OpCode.ALL_REDUCE, OpState.ENQUEUED, 8, NOW - 0.5),)),
    )
    r0, r1 = rank_metrics(o, TIMEOUTS)
    assert r0.alive and not r0.hung and not r0.culprit
    assert r0.step == 10 and r0.step_seconds == 0.5
    assert r0.since_progress == pytest.approx(0.1)
    assert r0.hang_limit == pytest.approx(2.5)  # 5 x the slowest recent step
    assert r1.pending_ops == 1 and r0.pending_ops == 0
    assert r0.cpu_ratio == 0.25 and r0.straggler_score is None


def test_rank_metrics_flag_hung_ranks_and_the_culprit() -> None:
    stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 8, NOW - 30)
    o = observation(
        snap(0, last=NOW - 30, pending=(stuck,)),
        snap(1, last=NOW - 30),  # never joined #42
        snap(2, last=NOW - 30, pending=(stuck,)),
        snap(3, liveness=Liveness.CLOSED),
    )
    verdict = decide(WatchState(), o, Policy(timeouts=TIMEOUTS)).verdict
    assert verdict is not None and verdict.culprit == 1
    ranks = {r.rank: r for r in rank_metrics(o, TIMEOUTS, verdict)}
    assert [ranks[r].hung for r in range(4)] == [True, True, True, False]
    assert [ranks[r].culprit for r in range(4)] == [False, True, False, False]
    assert ranks[3].hang_limit is None and not ranks[3].alive
    assert ranks[0].since_progress == pytest.approx(30)


def test_a_rank_in_warm_up_is_not_hung_at_the_adaptive_limit() -> None:
    o = observation(snap(0, last=NOW - 30, step=1, durations=()))
    (r,) = rank_metrics(o, TimeoutPolicy(ceiling=60, floor=2, warmup_timeout=900))
    assert not r.hung and r.hang_limit == 900 and r.step_seconds is None


# -- xpu_timer compatibility ----------------------------------------------------------------------


def dlrover_worker_hung(text: str) -> bool:
    """DLRover's reading, as documented: every XPU_TIMER_COMMON_HANG line's last digits are 1."""
    lines = [ln for ln in text.splitlines() if ln.startswith("XPU_TIMER_COMMON_HANG")]
    flags = [m.group(0) == "1" if (m := re.search(r"(\d+)(?!.*\d)", ln)) else False for ln in lines]
    return all(flags)  # zero lines count as hung, hence our placeholder line


def test_xpu_timer_gauge_reads_as_dlrover_expects() -> None:
    ident = XpuTimerIdentity(ip="10.0.0.7", pod_name="train-worker-0", job_name="train")
    stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 8, NOW - 30)
    hung = rank_metrics(
        observation(*(snap(r, last=NOW - 30, pending=(stuck,)) for r in range(2))), TIMEOUTS
    )
    healthy = rank_metrics(observation(snap(0), snap(1)), TIMEOUTS)
    text = render(ident, hung)
    assert dlrover_worker_hung(text)
    assert (
        'XPU_TIMER_COMMON_HANG{ip="10.0.0.7",job_name="train",local_rank="1",pod_name="train-worker-0",rank="1"} 1'
        in text
    )
    assert not dlrover_worker_hung(render(ident, healthy))
    assert not dlrover_worker_hung(render(ident, (hung[0], healthy[1])))
    assert not dlrover_worker_hung(render(ident, ()))
    # And it is a valid exposition that Prometheus reads too.
    (fam,) = text_string_to_metric_families(text)
    assert fam.type == "gauge" and [s.value for s in fam.samples] == [1.0, 1.0]


def test_xpu_timer_identity_from_env() -> None:
    env = {"POD_IP": "10.1.2.3", "POD_NAME": "w-3", "ENV_ARGO_WORKFLOW_NAME": "wf"}
    assert XpuTimerIdentity.from_env(env, "job") == XpuTimerIdentity("10.1.2.3", "w-3", "wf")
    assert XpuTimerIdentity.from_env({}, "job") == XpuTimerIdentity("NOT_SET", "NOT_SET", "job")


# -- checkpoint, precheck, GPU, host --------------------------------------------------------------


def registry_with(collector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def test_checkpoint_metrics_keep_the_last_facts_per_rank() -> None:
    clock = iter([100.0, 160.0, 220.0, 280.0]).__next__
    ckpt = CheckpointMetrics(lambda: "train", "n1", clock)
    ckpt.update(rank=0, memory_step=10, save_seconds=0.09)
    ckpt.update(rank=0, persisted_step=10, persist_seconds=4.5, persist_bytes=500_000_000)
    ckpt.update(rank=0, memory_step=20, save_seconds=0.11)
    ckpt.update(rank=1, memory_step=20)
    reg = registry_with(ckpt)

    def get(name: str, rank: str) -> float | None:
        return reg.get_sample_value(name, {"job": "train", "node": "n1", "rank": rank})

    assert get("diag_checkpoint_memory_step", "0") == 20
    assert get("diag_checkpoint_persisted_step", "0") == 10
    assert get("diag_checkpoint_save_seconds", "0") == pytest.approx(0.11)
    assert get("diag_checkpoint_persist_seconds", "0") == 4.5
    assert get("diag_checkpoint_persist_bytes", "0") == 500_000_000
    assert get("diag_checkpoint_memory_timestamp_seconds", "0") == 220.0  # advanced at 20
    assert get("diag_checkpoint_persisted_timestamp_seconds", "0") == 160.0
    assert get("diag_checkpoint_persisted_step", "1") is None  # never persisted: absent
    assert get("diag_checkpoint_memory_timestamp_seconds", "1") == 280.0


def test_precheck_textfile_is_reexported(tmp_path: Path) -> None:
    path = tmp_path / "precheck.prom"
    coll = PrecheckFileCollector(path)
    reg = registry_with(coll)
    assert generate_latest(reg) == b""  # no precheck ran
    path.write_text(
        "# TYPE diag_precheck_node_status gauge\n"
        'diag_precheck_node_status{job="train",node="n2",status="faulty"} 1\n'
        "# TYPE diag_precheck_exit_code gauge\n"
        'diag_precheck_exit_code{job="train"} 4\n'
        "# TYPE node_load1 gauge\n"
        "node_load1 3\n"
    )
    labels = {"job": "train", "node": "n2", "status": "faulty"}
    assert reg.get_sample_value("diag_precheck_node_status", labels) == 1
    assert reg.get_sample_value("diag_precheck_exit_code", {"job": "train"}) == 4
    assert reg.get_sample_value("node_load1") is None  # not ours to re-export
    path.write_text('diag_precheck_exit_code{job="train"} 0\n')
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    assert reg.get_sample_value("diag_precheck_exit_code", {"job": "train"}) == 0
    path.write_text("this is { not the text format\n")
    os.utime(path, ns=(2, 2))
    assert generate_latest(reg) == b""


def test_gpu_families_from_readings() -> None:
    readings = [
        GpuReading(0, 0.87, 30 << 30, 80 << 30, 61.0, 412.5, 3, 0, xid_errors=2, last_xid=79),
        GpuReading(1, None, None, None, None, None, None, None),  # everything unsupported
    ]
    reg = CollectorRegistry(auto_describe=False)

    class Fixed:
        def collect(self):
            return gpu_families("n1", readings)

    reg.register(Fixed())
    g0 = {"node": "n1", "gpu": "0"}
    assert reg.get_sample_value("diag_gpu_utilization_ratio", g0) == 0.87
    assert reg.get_sample_value("diag_gpu_power_watts", g0) == 412.5
    assert reg.get_sample_value("diag_gpu_xid_errors_total", g0) == 2
    assert reg.get_sample_value("diag_gpu_last_xid", g0) == 79
    assert reg.get_sample_value("diag_gpu_ecc_errors_total", {**g0, "type": "uncorrected"}) == 0
    assert reg.get_sample_value("diag_gpu_xid_errors_total", {"node": "n1", "gpu": "1"}) == 0
    assert reg.get_sample_value("diag_gpu_temperature_celsius", {"node": "n1", "gpu": "1"}) is None


def test_host_collector_reads_this_machine() -> None:
    reg = registry_with(HostCollector("n1"))
    node = {"node": "n1"}
    st = os.statvfs("/dev/shm")
    used = reg.get_sample_value("diag_host_shm_used_bytes", node)
    free = reg.get_sample_value("diag_host_shm_free_bytes", node)
    assert used + free == pytest.approx(st.f_blocks * st.f_frsize, rel=0.05)
    assert reg.get_sample_value("diag_host_cpu_cores", node) == psutil.cpu_count()
    total = reg.get_sample_value("diag_host_memory_total_bytes", node)
    assert 0 < reg.get_sample_value("diag_host_memory_available_bytes", node) <= total
    assert reg.get_sample_value("diag_host_cpu_busy_seconds_total", node) > 0
    rss = reg.get_sample_value("diag_agent_resident_memory_bytes", node)
    assert rss == pytest.approx(psutil.Process().memory_info().rss, rel=0.2)
    assert reg.get_sample_value("diag_agent_cpu_seconds_total", node) > 0


# -- the exporter as the loop feeds it ------------------------------------------------------------


def make_metrics(**kw) -> AgentMetrics:
    return AgentMetrics("n1", TIMEOUTS, gpu=False, clock=lambda: 1.7e9, **kw)


def test_collective_histograms_count_each_completion_once() -> None:
    m = make_metrics()
    ops0 = [done(s, s * 1.0, s * 1.0 + 0.003) for s in range(1, 4)]
    m.update(observation(snap(0), recent={0: tuple(ops0)}), WatchState())
    m.update(observation(snap(0), recent={0: tuple(ops0)}), WatchState())  # nothing new
    ops0.append(done(4, 4.0, 4.2, code=OpCode.ALL_GATHER_BASE))
    m.update(observation(snap(0), recent={0: tuple(ops0)}), WatchState())
    labels = {"job": "train", "node": "n1", "rank": "0", "local_rank": "0", "op": "all_reduce"}
    get = m.registry.get_sample_value
    assert get("diag_collective_latency_seconds_count", labels) == 3
    assert get("diag_collective_latency_seconds_bucket", {**labels, "le": "0.0025"}) == 0
    assert get("diag_collective_latency_seconds_bucket", {**labels, "le": "0.005"}) == 3
    assert get("diag_collective_bytes_total", labels) == 3 << 20
    gather = {**labels, "op": "all_gather"}
    assert get("diag_collective_latency_seconds_count", gather) == 1
    # A group of one rank moves nothing over the bus.
    assert get("diag_collective_busbw_bytes_per_second", gather) == 0
    # The rank restarts: a new journal, new op objects, counted again from its first op.
    restarted = tuple(done(s, s * 1.0, s * 1.0 + 0.003) for s in range(1, 3))
    m.update(observation(snap(0), recent={0: restarted}), WatchState())
    assert get("diag_collective_latency_seconds_count", labels) == 5


def test_incidents_are_counted_at_the_verdict_and_evidence_when_on_disk(tmp_path: Path) -> None:
    m = make_metrics()
    o = observation(snap(0), snap(1))
    m.update(o, WatchState())
    base = {"job": "train", "node": "n1"}
    get = m.registry.get_sample_value
    assert get("diag_incidents_total", {**base, "kind": "hang"}) == 0  # present before the first
    assert get("diag_incident_open", {**base, "kind": "hang"}) == 0
    v = Verdict(VerdictKind.HANG, "a0-hang", NOW, 1, (), (), (), "hang", expired_at=NOW - 0.3)
    m.update(o, WatchState(incident=v), v)
    assert get("diag_incidents_total", {**base, "kind": "hang"}) == 1
    assert get("diag_incident_open", {**base, "kind": "hang"}) == 1
    assert get("diag_rank_culprit", {**base, "rank": "1", "local_rank": "1"}) == 1
    assert get("diag_incident_detection_delay_seconds_sum", base) == pytest.approx(0.3)
    assert get("diag_incident_last_timestamp_seconds", base) == 1.7e9
    ev = EvidenceResult(tmp_path, (), started=10.0, on_disk=10.4, finished=11.5)
    m.on_incident(IncidentReport(v, ev, "train", "n1"))
    assert get("diag_evidence_seconds_sum", {**base, "stage": "on_disk"}) == pytest.approx(0.4)
    assert get("diag_evidence_seconds_sum", {**base, "stage": "complete"}) == pytest.approx(1.5)
    m.iteration_done(0.002)
    assert get("diag_agent_iterations_total", {"node": "n1"}) == 1
    assert get("diag_agent_last_iteration_timestamp_seconds", {"node": "n1"}) == 1.7e9


def test_a_recover_round_is_counted_by_outcome() -> None:
    m = make_metrics()
    m.update(observation(snap(0), snap(1), snap(2)), WatchState())
    m.recover_in_place("train", took=2, stopped=1, not_asked=0)
    m.recover_in_place("", took=1, stopped=0, not_asked=2)  # the job the agent watches
    get = m.registry.get_sample_value
    base = {"job": "train", "node": "n1"}
    assert get("diag_in_place_recoveries_total", {**base, "outcome": "took"}) == 3
    assert get("diag_in_place_recoveries_total", {**base, "outcome": "stopped"}) == 1
    assert get("diag_in_place_recoveries_total", {**base, "outcome": "not_asked"}) == 2


def test_render_appends_the_xpu_timer_gauge_only_when_asked() -> None:
    o = observation(snap(0))
    plain = make_metrics()
    plain.update(o, WatchState())
    assert b"XPU_TIMER_COMMON_HANG" not in plain.render()
    compat = make_metrics(xpu_timer=XpuTimerIdentity(job_name="train"))
    body = compat.render()
    assert body.endswith(b'rank="NOT_SET"} 0\n')  # no ranks yet: one line reading 0
    compat.update(o, WatchState())
    text = compat.render().decode()
    names = {fam.name for fam in text_string_to_metric_families(text)}
    assert {"XPU_TIMER_COMMON_HANG", "diag_rank_hung", "diag_host_cpu_cores"} <= names


def test_every_declared_family_is_exposed_by_the_exporter_or_a_listed_adapter() -> None:
    m = make_metrics()
    m.update(observation(snap(0), recent={0: (done(1, 0, 0.1),)}), WatchState())
    exposed = {
        s.name for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples
    }
    gpu = {fam.name for fam in f.FAMILIES if fam.name.startswith("diag_gpu_")}
    helps = {fam.name for fam in text_string_to_metric_families(m.render().decode())}
    for fam in f.FAMILIES:
        assert fam.help and fam.labels, fam.name
        if fam.name in gpu:
            continue  # no NVML here; gpu_families() is tested with readings
        assert fam.name in helps or any(n in exposed for n in fam.exposed), fam.name
    assert len({fam.name for fam in f.FAMILIES}) == len(f.FAMILIES)


def test_lean_exposition_writes_what_prometheus_client_writes() -> None:
    reg = CollectorRegistry(auto_describe=False)
    ckpt = CheckpointMetrics(lambda: 'we"ird\\job\nname', "n1", lambda: 5.0)
    ckpt.update(rank=0, memory_step=3, save_seconds=0.25)
    reg.register(ckpt)
    h = Histogram(
        "diag_x_seconds", "a help\nwith a newline", ["op"], registry=reg, buckets=(0.1, 1)
    )
    h.labels("all_reduce").observe(0.5)
    m = make_metrics()
    m.update(observation(snap(0), snap(1), recent={0: (done(1, 0, 0.1),)}), WatchState())
    for registry in (reg, m.registry):
        # Host and agent values move between two reads; compare the rest.
        assert stable(render_text(registry)) == stable(generate_latest(registry))
        writer = TextWriter()  # the second time from its cache of label strings
        assert stable(writer.render(registry)) == stable(writer.render(registry))
        assert stable(writer.render(registry)) == stable(generate_latest(registry))


def stable(text: bytes) -> bytes:
    return b"".join(
        ln for ln in text.splitlines(True) if b"diag_host_" not in ln and b"diag_agent_" not in ln
    )


# -- configuration --------------------------------------------------------------------------------


def load(argv: list[str], env: dict[str, str]):
    import argparse

    parser = argparse.ArgumentParser()
    config_mod.add_arguments(parser)
    return config_mod.load(parser.parse_args(argv), env)


def test_xpu_timer_compat_takes_the_port_dlrover_scrapes(tmp_path: Path) -> None:
    base = ["--run-dir", str(tmp_path)]
    cfg = load(
        [*base, "--xpu-timer-compat", "true"], {"XPU_TIMER_PORT": "18889", "POD_IP": "1.2.3.4"}
    )
    assert cfg.metrics_port == 18889 and cfg.xpu_timer is not None and cfg.xpu_timer.ip == "1.2.3.4"
    cfg = load(
        [*base, "--metrics-port", "9400"], {"DIAG_XPU_TIMER_COMPAT": "1", "XPU_TIMER_PORT": "1"}
    )
    assert cfg.metrics_port == 9400
    with pytest.raises(UsageError, match="XPU_TIMER_PORT"):
        load([*base, "--xpu-timer-compat", "true"], {})
    cfg = load(base, {})
    assert cfg.xpu_timer is None and cfg.metrics_port is None
    assert cfg.precheck_metrics == tmp_path / "precheck.prom"
