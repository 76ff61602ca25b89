"""Classification of nodes from their own evidence, presence, and links; plus the small pure
helpers (units, merging pair sides, heartbeats, device pair specs)."""

from __future__ import annotations

import pytest

from diag.agent.node.linkstate import NicState
from diag.agent.node.units import fmt_flops, fmt_rate, parse_rate, parse_size
from diag.agent.precheck.classify import Observations, classify
from diag.agent.precheck.grading import Thresholds
from diag.agent.precheck.liveness import BeatTracker, pair_limit_s, round_limit_s
from diag.agent.precheck.measure import busbw
from diag.agent.precheck.measurements import (
    Check,
    ComputeResult,
    CopyResult,
    DeviceHealth,
    LocalEvidence,
    PairResult,
    PairSide,
    Severity,
    merge_sides,
)
from diag.agent.precheck.precheckconfig import DevicePairs

TH = Thresholds()


def _full_mesh_ok(n: int, rate: float = 800e6) -> tuple[PairResult, ...]:
    return tuple(PairResult(1, a, b, rate) for a in range(n) for b in range(a + 1, n))


def _local(node: int, flops: float = 50e9, **kw) -> LocalEvidence:
    return LocalEvidence(node=node, compute=(ComputeResult("cpu", flops),), **kw)


def _run(n: int, *, local=None, pairs=None, joined=None, lost=None) -> dict[int, tuple]:
    obs = Observations(
        nnodes=n,
        joined=frozenset(range(n) if joined is None else joined),
        lost=lost or {},
        local=local or {i: _local(i) for i in range(n)},
        pairs=_full_mesh_ok(n) if pairs is None else pairs,
        rdzv_timeout_s=30,
    )
    a = classify(obs, TH)
    return {v.node: (v.status, v.reason) for v in a.verdicts}


@pytest.mark.parametrize(
    ("device", "status", "words"),
    [
        (DeviceHealth(0, memory_used_fraction=0.1, temperature_c=60), Severity.HEALTHY, ""),
        (DeviceHealth(0, memory_used_fraction=0.45), Severity.FAULTY, "45% of its memory"),
        (DeviceHealth(0, ecc_uncorrected=3), Severity.FAULTY, "3 uncorrected ECC"),
        (DeviceHealth(0, xid_errors=(79,)), Severity.FAULTY, "XID 79"),
        (DeviceHealth(0, remap_failed=True), Severity.FAULTY, "row remapping failed"),
        (DeviceHealth(0, temperature_c=92), Severity.STRAGGLER, "92 C"),
        (DeviceHealth(0, error="GPU is lost"), Severity.FAULTY, "GPU is lost"),
    ],
)
def test_device_health_rules(device, status, words):
    verdicts = _run(3, local={0: _local(0, devices=(device,)), 1: _local(1), 2: _local(2)})
    assert verdicts[0][0] is status
    assert words in verdicts[0][1]
    assert verdicts[1][0] is verdicts[2][0] is Severity.HEALTHY


@pytest.mark.parametrize(
    ("flops", "status"),
    [(50e9, Severity.HEALTHY), (26e9, Severity.HEALTHY), (24e9, Severity.STRAGGLER)],
)
def test_compute_against_the_median_of_all_devices(flops, status):
    local = {0: _local(0), 1: _local(1, flops), 2: _local(2), 3: _local(3)}
    verdicts = _run(4, local=local)
    assert verdicts[1][0] is status
    if status is Severity.STRAGGLER:
        assert "24 GFLOP/s" in verdicts[1][1] and "median 50 GFLOP/s" in verdicts[1][1]


def test_compute_error_is_faulty():
    local = {
        0: _local(0),
        1: LocalEvidence(1, compute=(ComputeResult("cuda:3", error="CUDA error"),)),
    }
    assert _run(2, local=local)[1] == (Severity.FAULTY, "matmul on cuda:3 failed: CUDA error")


@pytest.mark.parametrize(
    ("th", "bw", "status"),
    [
        (TH, 40e9, Severity.HEALTHY),
        (TH, 10e9, Severity.STRAGGLER),  # < 0.5 x median
        (Thresholds(min_copy_bw=45e9), 40e9, Severity.STRAGGLER),  # below the floor
    ],
)
def test_intra_node_copies(th, bw, status):
    def copies(b):
        return (CopyResult(0, 1, 40e9), CopyResult(1, 0, b))

    local = {i: _local(i, copies=copies(bw if i == 1 else 40e9)) for i in range(3)}
    obs = Observations(3, frozenset(range(3)), local=local, pairs=_full_mesh_ok(3))
    a = classify(obs, th)
    assert a.verdicts[1].status is status
    assert a.median_copy == 40e9
    assert a.verdicts[1].copy_bw == bw


def test_copy_failure_is_faulty():
    local = {0: _local(0, copies=(CopyResult(0, 1, error="peer access denied"),)), 1: _local(1)}
    status, reason = _run(2, local=local)[0]
    assert status is Severity.FAULTY and "copy GPU 0-1 failed" in reason


def test_missing_and_lost_nodes_are_faulty_and_their_failed_links_blame_no_one():
    pairs = (
        PairResult(1, 0, 1, 800e6),
        PairResult(1, 2, 3, None, "node 3 reported no result"),
        PairResult(2, 1, 2, 800e6),
    )
    verdicts = _run(5, joined={0, 1, 2, 3}, lost={3: "no heartbeat for 4 s"}, pairs=pairs)
    assert verdicts[3] == (Severity.FAULTY, "no heartbeat for 4 s")
    assert verdicts[4] == (Severity.FAULTY, "did not join within 30 s")
    assert {n: s for n, (s, _) in verdicts.items() if n < 3} == dict.fromkeys(
        range(3), Severity.HEALTHY
    )


def test_two_nodes_one_missing_blames_the_missing_one():
    verdicts = _run(2, joined={0}, local={0: _local(0)}, pairs=())
    assert verdicts[1][0] is Severity.FAULTY and verdicts[0][0] is Severity.HEALTHY


def test_nobody_else_reachable_is_an_error_not_a_verdict():
    obs = Observations(4, frozenset({0}), local={0: _local(0)}, rdzv_timeout_s=30)
    a = classify(obs, TH)
    assert a.error and "node 0" in a.error
    assert a.nodes_with(Severity.FAULTY) == []
    assert a.nodes_with(Severity.SUSPECT) == [1, 2, 3]


def test_failed_path_between_two_working_nodes_makes_both_suspect():
    pairs = (
        PairResult(1, 0, 1, 800e6),
        PairResult(1, 2, 3, 800e6),
        PairResult(2, 1, 2, 800e6),
        PairResult(2, 3, 0, 800e6),
        PairResult(3, 0, 2, None, "timed out"),
    )
    verdicts = _run(4, pairs=pairs)
    assert verdicts[0][0] is verdicts[2][0] is Severity.SUSPECT
    assert "link to node 2 failed (timed out)" in verdicts[0][1]
    assert verdicts[1][0] is verdicts[3][0] is Severity.HEALTHY


def test_failure_explained_by_a_partner_flagged_on_its_own_evidence():
    # Node 2's GPU is broken; node 1 failed only with node 2: node 1 is not blamed.
    local = {i: _local(i) for i in range(3)}
    local[2] = _local(2, devices=(DeviceHealth(0, ecc_uncorrected=1),))
    pairs = (PairResult(1, 0, 1, 800e6), PairResult(2, 1, 2, None, "reset"))
    verdicts = _run(3, local=local, pairs=pairs)
    assert verdicts[1][0] is Severity.HEALTHY
    assert verdicts[2][0] is Severity.FAULTY


def test_findings_record_their_check():
    obs = Observations(
        2,
        frozenset({0, 1}),
        local={
            0: _local(0),
            1: _local(1, nic=NicState(iface="eth0", carrier=False, operstate="lowerlayerdown")),
        },
        pairs=(PairResult(1, 0, 1, None, "timed out"),),
    )
    v = classify(obs, TH).verdicts[1]
    assert [f.check for f in v.findings] == [Check.NIC]
    assert v.reason == "interface eth0 has no carrier (operstate lowerlayerdown)"


# -- small pure helpers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100Mbit", 12.5e6),
        ("1.5GB/s", 1.5e9),
        ("25 Gbit", 3.125e9),
        ("800MB/s", 800e6),
        ("1000", 1000.0),
    ],
)
def test_parse_rate(text, value):
    assert parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [("4MiB", 4 << 20), ("64MB", 64_000_000), ("17", 17)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["fast", "10 parsecs", "", "1.2.3MB/s"])
def test_parse_rate_rejects(bad):
    with pytest.raises(ValueError, match="bad rate"):
        parse_rate(bad)


def test_formatting():
    assert fmt_rate(11.9e6) == "11.9 MB/s"
    assert fmt_rate(790e6) == "790 MB/s"
    assert fmt_rate(None) == "-"
    assert fmt_flops(46.2e9) == "46.2 GFLOP/s"


def test_busbw_follows_nccl_tests():
    # 2 ranks: busbw = algbw; 8 ranks: busbw = algbw x 2*7/8.
    assert busbw(100, 1.0) == 100
    assert busbw(100, 1.0, world=8) == pytest.approx(175)


def test_merge_sides():
    a = PairSide(1, 0, 1, busbw=900e6, iters=5)
    b = PairSide(1, 1, 0, busbw=880e6, iters=5)
    assert merge_sides(1, 0, 1, [a, b]) == PairResult(1, 0, 1, 880e6, None)
    failed = merge_sides(1, 0, 1, [a, PairSide(1, 1, 0, error="Connection reset by peer")])
    assert not failed.ok and "node 1: Connection reset by peer" in (failed.error or "")
    missing = merge_sides(1, 0, 1, [a])
    assert missing.error == "node 1 reported no result"


def test_beat_tracker_uses_the_observers_clock():
    t = BeatTracker(lost_after_s=3.0)
    t.observe(0, 1, now=10.0)
    t.observe(1, 1, now=10.0)
    t.observe(0, 2, now=12.0)
    t.observe(1, 1, now=12.0)  # no change: still silent since 10.0
    assert t.stale(now=13.5) == [1]
    assert t.silent_for(1, now=13.5) == 3.5
    assert t.stale(now=15.5) == [0, 1]
    assert t.silent_for(7, now=1.0) is None


def test_round_limit_covers_every_timeout():
    # connect 5 + budget 1 + (warm-up + last timed op) 2 x 5 + 2 slack, then 4 to post + 5
    assert pair_limit_s(connect_s=5, collective_s=5, pair_seconds=1, warmup_iters=1) == 18
    assert round_limit_s(5, 5, 1, 1, lost_after_s=4) == 27


@pytest.mark.parametrize(
    ("spec", "count", "pairs"),
    [
        ("ring", 4, [(0, 1), (1, 2), (2, 3), (3, 0)]),
        ("ring", 1, []),
        ("all", 3, [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]),
        ("0-1,2-3", 4, [(0, 1), (2, 3)]),
        ("0-1,6-7", 4, [(0, 1)]),
    ],
)
def test_device_pairs(spec, count, pairs):
    assert DevicePairs.parse(spec).resolve(count) == pairs


@pytest.mark.parametrize("bad", ["0-0", "0:1", "a-b", "1"])
def test_device_pairs_reject(bad):
    with pytest.raises(ValueError, match="bad device pair"):
        DevicePairs.parse(bad)
