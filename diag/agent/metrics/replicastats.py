"""Replica facts as metrics: what this node sent to its holders, what it holds for its peers,
where its ranks' memory came from at the agent's start, and which lost peers' replicas it wrote
to storage (agent.replica and agent.replication report them)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from diag.agent.metrics import families as f


@dataclass(frozen=True)
class ReplicaFacts:
    sent_step: int | None = None
    pushes: int = 0
    push_failures: int = 0
    push_seconds: float | None = None
    push_bytes: int | None = None
    held: dict[str, int] = field(default_factory=dict)  # peer node -> step held for it
    restore_source: str | None = None  # local, peer, storage, none
    restore_step: int | None = None
    restore_seconds: float | None = None
    handed_over: dict[str, int] = field(default_factory=dict)  # lost peer -> step written
    handover_failures: int = 0
    restore_fallbacks: int = 0  # launches resumed from storage with a step in memory
    node_mismatches: int = 0  # ranks that registered naming another node than the agent's


class ReplicaMetrics(Collector):
    def __init__(self, job: Callable[[], str], node: str) -> None:
        self.job = job
        self.node = node
        self._lock = threading.Lock()
        self._facts = ReplicaFacts()

    def update(self, facts: ReplicaFacts) -> None:
        with self._lock:
            self._facts = facts

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            fact = self._facts
        labels = [self.job(), self.node]
        for fam, value in (
            (f.REPLICA_SENT_STEP, fact.sent_step),
            (f.REPLICA_PUSHES, fact.pushes),
            (f.REPLICA_PUSH_FAILURES, fact.push_failures),
            (f.REPLICA_PUSH_SECONDS, fact.push_seconds),
            (f.REPLICA_PUSH_BYTES, fact.push_bytes),
            (f.REPLICA_RESTORE_SECONDS, fact.restore_seconds),
            (f.REPLICA_HANDOVER_FAILURES, fact.handover_failures),
            (f.RESTORE_FALLBACKS, fact.restore_fallbacks),
            (f.NODE_NAME_MISMATCHES, fact.node_mismatches),
        ):
            m = fam.new()
            if value is not None:
                m.add_metric(labels, value)
            yield m
        held = f.REPLICA_HELD_STEP.new()
        for peer, step in sorted(fact.held.items()):
            held.add_metric([*labels, peer], step)
        yield held
        handed = f.REPLICA_HANDED_OVER_STEP.new()
        for peer, step in sorted(fact.handed_over.items()):
            handed.add_metric([*labels, peer], step)
        yield handed
        restore = f.REPLICA_RESTORE_STEP.new()
        if fact.restore_source is not None and fact.restore_step is not None:
            restore.add_metric([*labels, fact.restore_source], fact.restore_step)
        yield restore
