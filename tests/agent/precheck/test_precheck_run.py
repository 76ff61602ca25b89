"""`diag precheck` as real processes on this host (loopback, no root needed): the healthy path,
a node that never comes, a rendezvous that is not there, and nodes dying mid-run."""

from __future__ import annotations

import time

import pytest
from jobrun import free_port
from netlab import Cluster
from prometheus_client.parser import text_string_to_metric_families

from diag.formats import exitcodes


@pytest.fixture
def cluster_factory(tmp_path):
    made: list[Cluster] = []

    def make(n: int) -> Cluster:
        workdir = tmp_path / f"c{len(made)}"
        workdir.mkdir()
        c = Cluster(n, workdir, free_port())
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.mark.timeout(120)
def test_two_healthy_nodes(cluster_factory, tmp_path):
    c = cluster_factory(2)
    metrics = tmp_path / "node0.prom"
    c.start(0, "--rdzv-timeout", "60", "--metrics-file", str(metrics), "--job", "t1")
    c.start(1, "--rdzv-timeout", "60", "--job", "t1")
    assert c.wait_all(90) == {0: exitcodes.OK, 1: exitcodes.OK}, c.logs()
    for rank in (0, 1):
        r = c.nodes[rank].report()
        assert r["outcome"] == "healthy" and r["reported_by"] == rank
        assert (r["faulty"], r["stragglers"], r["suspects"]) == ([], [], [])
        assert r["rounds"] == [[[0, 1]]]
        for node in r["nodes"]:
            assert node["status"] == "healthy"
            assert node["busbw_bytes_per_s"] > 0
            assert node["compute_flops"] > 0
            assert node["links"][0]["grade"] == "good"
            assert node["nic"]["iface"] == "lo"
        assert "all nodes healthy" in c.nodes[rank].out.read_text()
    fams = {f.name: f for f in text_string_to_metric_families(metrics.read_text())}
    status = fams["diag_precheck_node_status"].samples
    assert {(s.labels["node"], s.labels["status"]) for s in status if s.value == 1} == {
        ("0", "healthy"),
        ("1", "healthy"),
    }
    assert all(s.labels["job"] == "t1" for f in fams.values() for s in f.samples)


@pytest.mark.timeout(60)
def test_node_that_never_joins_is_faulty(cluster_factory):
    c = cluster_factory(2)
    c.start(0, "--rdzv-timeout", "3")
    assert c.wait_all(45) == {0: exitcodes.PRECHECK_FAULTY}, c.logs()
    r = c.nodes[0].report()
    assert r["faulty"] == [1]
    assert r["nodes"][1]["reason"] == "did not join within 3 s"
    assert r["nodes"][0]["status"] == "healthy"


@pytest.mark.timeout(60)
def test_rendezvous_host_missing_is_could_not_run(cluster_factory):
    c = cluster_factory(3)
    t0 = time.monotonic()
    c.start(2, "--rdzv-timeout", "2")
    assert c.wait_all(45) == {2: exitcodes.PRECHECK_ERROR}, c.logs()
    assert time.monotonic() - t0 < 40
    r = c.nodes[2].report()
    assert r["outcome"] == "error" and r["faulty"] == []
    assert r["error"].startswith("could not reach the rendezvous at 127.0.0.1:")
    assert "could not run" in c.nodes[2].out.read_text()


@pytest.mark.timeout(120)
def test_node_killed_mid_run_is_faulty_and_does_not_hang_the_others(cluster_factory):
    c = cluster_factory(3)
    c.start_all("--rdzv-timeout", "60")
    c.nodes[2].wait_log(r"round \d+: testing the link", 90)
    c.nodes[2].kill()
    rcs = c.wait_all(60)
    assert rcs[0] == rcs[1] == exitcodes.PRECHECK_FAULTY, c.logs()
    for rank in (0, 1):
        r = c.nodes[rank].report()
        assert (r["faulty"], r["stragglers"], r["suspects"]) == ([2], [], []), c.logs()
        assert "no heartbeat" in r["nodes"][2]["reason"] or "no result" in r["nodes"][2]["reason"]


@pytest.mark.timeout(120)
def test_losing_the_rendezvous_host_mid_run_is_could_not_run(cluster_factory):
    c = cluster_factory(2)
    c.start_all("--rdzv-timeout", "60")
    c.nodes[1].wait_log(r"local checks done", 90)
    c.nodes[0].kill()
    t0 = time.monotonic()
    assert c.nodes[1].wait(60) == exitcodes.PRECHECK_ERROR, c.logs()
    assert time.monotonic() - t0 < 45
    r = c.nodes[1].report()
    assert r["outcome"] == "error" and r["faulty"] == []
    assert "node 0" in r["error"]
