"""Replica facts as Prometheus samples: sent, held per peer, the restore's source and step, and
the lost peers' replicas written to storage."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from diag.agent.metrics.replicastats import ReplicaFacts, ReplicaMetrics


def test_replica_metrics_show_sends_holdings_and_the_restore() -> None:
    m = ReplicaMetrics(lambda: "train", "w1")
    reg = CollectorRegistry(auto_describe=False)
    reg.register(m)
    node = {"job": "train", "node": "w1"}
    assert reg.get_sample_value("diag_replica_sent_step", node) is None  # nothing yet
    m.update(
        ReplicaFacts(
            sent_step=42, pushes=7, push_failures=1, push_seconds=0.25, push_bytes=1 << 30,
            held={"w0": 40}, restore_source="peer", restore_step=39, restore_seconds=1.5,
            handed_over={"w0": 40}, handover_failures=2,
        )
    )  # fmt: skip
    assert reg.get_sample_value("diag_replica_sent_step", node) == 42
    assert reg.get_sample_value("diag_replica_pushes_total", node) == 7
    assert reg.get_sample_value("diag_replica_push_failures_total", node) == 1
    assert reg.get_sample_value("diag_replica_push_bytes", node) == 1 << 30
    assert reg.get_sample_value("diag_replica_held_step", {**node, "peer": "w0"}) == 40
    assert reg.get_sample_value("diag_replica_restore_step", {**node, "source": "peer"}) == 39
    assert reg.get_sample_value("diag_replica_restore_seconds", node) == 1.5
    assert reg.get_sample_value("diag_replica_handed_over_step", {**node, "peer": "w0"}) == 40
    assert reg.get_sample_value("diag_replica_handover_failures_total", node) == 2
