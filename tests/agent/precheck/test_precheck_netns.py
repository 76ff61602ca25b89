"""`diag precheck` across network namespaces: every node is a real process in its own
namespace, linked to a bridge by a veth pair; links are shaped with tbf or cut.

A process killed mid-run is covered over loopback in test_precheck_run.py (3 nodes) and here
with 2 nodes."""

from __future__ import annotations

import pytest
from netlab import Cluster, NetLab, netns_unavailable

from diag.formats import exitcodes

pytestmark = pytest.mark.netns

PORT = 29500  # inside our own namespaces: no clash with anything else on the host
# Far below what an unshaped link gives even on a loaded 2-core machine: a gloo all-reduce over
# veth is CPU-bound there, and an unshaped link was once measured at 47.6 MB/s under the load of
# other suites, within the thresholds' ratio of a 100 Mbit/s one (12.5 MB/s).
SHAPED = "25mbit"
SHAPED_BYTES_PER_S = 25e6 / 8


@pytest.fixture
def lab(tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    labs: list[NetLab] = []
    clusters: list[Cluster] = []

    def make(n: int) -> tuple[NetLab, Cluster]:
        net = NetLab(n)
        labs.append(net)  # before build: a half-built lab is torn down too
        net.build()
        workdir = tmp_path / f"lab{len(labs)}"
        workdir.mkdir()
        cluster = Cluster(n, workdir, PORT, net)
        clusters.append(cluster)
        return net, cluster

    try:
        yield make
    finally:
        for c in clusters:
            c.stop()
        for net in labs:
            net.close()


def _verdict(r: dict) -> tuple[list[int], list[int], list[int]]:
    return r["faulty"], r["stragglers"], r["suspects"]


def _all_agree(c: Cluster, ranks, expected) -> list[dict]:
    reports = []
    for rank in ranks:
        r = c.nodes[rank].report()
        assert _verdict(r) == expected, f"node {rank}: {r['nodes']}\n{c.logs()}"
        reports.append(r)
    return reports


@pytest.mark.timeout(240)
def test_healthy_runs_report_nothing_repeatedly(lab, long_tier):
    net, first = lab(4)
    for attempt in range(2 if long_tier else 1):
        workdir = first.workdir / f"run{attempt}"
        workdir.mkdir()
        c = Cluster(4, workdir, PORT + attempt, net)
        try:
            c.start_all("--rdzv-timeout", "60")
            assert c.wait_all(150) == dict.fromkeys(range(4), exitcodes.OK), c.logs()
            for r in _all_agree(c, range(4), ([], [], [])):
                assert r["outcome"] == "healthy"
                assert all(n["busbw_bytes_per_s"] > 50e6 for n in r["nodes"])
                assert all(n["nic"]["iface"] == "eth0" for n in r["nodes"] if n["node"] == 0)
        finally:
            c.stop()


@pytest.mark.timeout(240)
def test_shaped_link_is_a_straggler_with_its_measured_bandwidth(lab):
    net, c = lab(5)
    net.shape(3, SHAPED)
    c.start_all("--rdzv-timeout", "60")
    rcs = c.wait_all(180)
    assert rcs == dict.fromkeys(range(5), exitcodes.PRECHECK_FAULTY), c.logs()
    for r in _all_agree(c, range(5), ([], [3], [])):
        node = r["nodes"][3]
        assert node["status"] == "straggler"
        # The report carries the link's real rate: tbf at 100 Mbit/s is 12.5 MB/s.
        assert 0.3 * SHAPED_BYTES_PER_S < node["busbw_bytes_per_s"] < 1.1 * SHAPED_BYTES_PER_S
        assert r["median_busbw_bytes_per_s"] > 4 * SHAPED_BYTES_PER_S
        assert "MB/s" in node["reason"] and "median" in node["reason"]
        assert all(x["grade"] == "slow" for x in node["links"])
    assert "stragglers [3]" in c.nodes[0].out.read_text()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_cut_link_before_start_is_faulty_from_both_sides(lab):
    net, c = lab(6)
    net.link_down(4)
    c.start_all("--rdzv-timeout", "15")
    rcs = c.wait_all(180)
    assert rcs == dict.fromkeys(range(6), exitcodes.PRECHECK_FAULTY), c.logs()
    for r in _all_agree(c, [0, 1, 2, 3, 5], ([4], [], [])):
        assert r["nodes"][4]["reason"] == "did not join within 15 s"
    # The cut-off node cannot reach anyone, but its own NIC tells it that it is the bad one.
    own = c.nodes[4].report()
    assert own["faulty"] == [4] and own["error"].startswith("could not reach the rendezvous")
    assert "no carrier" in own["nodes"][0]["reason"]


@pytest.mark.timeout(240)
def test_link_cut_mid_run_is_faulty(lab):
    net, c = lab(4)
    c.start_all("--rdzv-timeout", "60")
    c.nodes[2].wait_log(r"round 1: testing the link", 120)
    net.link_down(2)
    rcs = c.wait_all(150)
    assert rcs == dict.fromkeys(range(4), exitcodes.PRECHECK_FAULTY), c.logs()
    reports = _all_agree(c, [0, 1, 3], ([2], [], []))
    assert "no heartbeat" in reports[0]["nodes"][2]["reason"]
    own = c.nodes[2].report()
    assert own["faulty"] == [2] and "no carrier" in own["nodes"][0]["reason"]


@pytest.mark.timeout(240)
def test_three_nodes_isolate_a_shaped_link(lab):
    net, c = lab(3)
    net.shape(1, SHAPED)
    c.start_all("--rdzv-timeout", "60")
    assert c.wait_all(180) == dict.fromkeys(range(3), 4), c.logs()
    for r in _all_agree(c, range(3), ([], [1], [])):
        assert sorted(tuple(sorted(p)) for rnd in r["rounds"] for p in rnd) == [
            (0, 1),
            (0, 2),
            (1, 2),
        ]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_two_nodes_dead_node_and_cut_link_are_named(lab):
    # A dead process or a cut cable is attributable even with 2 nodes.
    net, c = lab(2)
    c.start_all("--rdzv-timeout", "60")
    c.nodes[1].wait_log(r"round 1: testing the link", 120)
    c.nodes[1].kill()
    assert c.nodes[0].wait(120) == 4, c.logs()
    _all_agree(c, [0], ([1], [], []))

    net.link_down(1)
    again = Cluster(2, c.workdir / "cut", PORT + 1, net)
    (c.workdir / "cut").mkdir()
    try:
        again.start_all("--rdzv-timeout", "10")
        assert again.wait_all(120) == {0: 4, 1: 4}, again.logs()
        _all_agree(again, [0, 1], ([1], [], []))
    finally:
        again.stop()


@pytest.mark.timeout(240)
def test_two_nodes_slow_link_is_a_suspect_pair(lab):
    # With 2 nodes a slow link cannot be pinned on either side: both are reported suspect.
    net, c = lab(2)
    net.shape(1, SHAPED)
    c.start_all("--rdzv-timeout", "60", "--min-busbw", "50MB/s")
    assert c.wait_all(120) == {0: 4, 1: 4}, c.logs()
    for r in _all_agree(c, [0, 1], ([], [], [0, 1])):
        assert "with 2 nodes" in r["nodes"][1]["reason"]
        assert r["nodes"][0]["busbw_bytes_per_s"] < 1.1 * SHAPED_BYTES_PER_S
