"""Checkpoint facts as metrics: what is in memory, what is on storage, and how long each took.

The flash checkpointer reports plain numbers through `CheckpointMetrics.update()`; the families
are rendered at scrape time from the latest facts per rank. A step that advances stamps the wall
time, which is what the stale-checkpoint alert compares with `time()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from diag.agent.metrics import families as f


@dataclass(frozen=True)
class CheckpointFacts:
    memory_step: int | None = None
    persisted_step: int | None = None
    save_seconds: float | None = None
    persist_seconds: float | None = None
    persist_bytes: int | None = None
    memory_at: float | None = None  # unix time the memory step last advanced
    persisted_at: float | None = None


class CheckpointMetrics(Collector):
    def __init__(
        self, job: Callable[[], str], node: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.job = job  # read at scrape time: the agent learns the job from the journals
        self.node = node
        self.clock = clock
        self._lock = threading.Lock()
        self._facts: dict[int, CheckpointFacts] = {}

    def update(
        self,
        *,
        rank: int,
        memory_step: int | None = None,
        persisted_step: int | None = None,
        save_seconds: float | None = None,
        persist_seconds: float | None = None,
        persist_bytes: int | None = None,
    ) -> None:
        """Records what changed for one rank; arguments left None keep their last value."""
        now = self.clock()
        with self._lock:
            old = self._facts.get(rank, CheckpointFacts())
            # Any: each value goes to the field of its own name, which mypy cannot pair up.
            changed: dict[str, Any] = {
                k: v
                for k, v in (
                    ("memory_step", memory_step),
                    ("persisted_step", persisted_step),
                    ("save_seconds", save_seconds),
                    ("persist_seconds", persist_seconds),
                    ("persist_bytes", persist_bytes),
                )
                if v is not None
            }
            new = replace(old, **changed)
            if memory_step is not None and memory_step != old.memory_step:
                new = replace(new, memory_at=now)
            if persisted_step is not None and persisted_step != old.persisted_step:
                new = replace(new, persisted_at=now)
            self._facts[rank] = new

    def facts(self) -> dict[int, CheckpointFacts]:
        with self._lock:
            return dict(self._facts)

    def collect(self) -> Iterator[Metric]:
        fields = (
            (f.CKPT_MEMORY_STEP, "memory_step"),
            (f.CKPT_PERSISTED_STEP, "persisted_step"),
            (f.CKPT_SAVE_SECONDS, "save_seconds"),
            (f.CKPT_PERSIST_SECONDS, "persist_seconds"),
            (f.CKPT_PERSIST_BYTES, "persist_bytes"),
            (f.CKPT_MEMORY_TIME, "memory_at"),
            (f.CKPT_PERSISTED_TIME, "persisted_at"),
        )
        facts = self.facts()
        job = self.job()
        for fam, attr in fields:
            m = fam.new()
            for rank, fact in sorted(facts.items()):
                value = getattr(fact, attr)
                if value is not None:
                    m.add_metric([job, self.node, str(rank)], value)
            yield m
