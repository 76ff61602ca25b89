"""Checkpoint facts the agent exposes (plain data; the metrics module reads them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from diag.agent.checkpoint.persist import PersistResult
from diag.agent.checkpoint.sessions import RankKey
from diag.formats.slotfile import Snapshot


@dataclass(frozen=True)
class RankCheckpointStats:
    job: str
    rank: int
    memory_step: int | None  # newest complete snapshot in shared memory
    memory_bytes: int  # its size
    last_copy_seconds: float  # how long the trainer took to copy it into shared memory
    persisted_step: int | None  # newest step this agent wrote to storage for the rank
    last_persist_seconds: float
    last_persist_bytes: int


@dataclass(frozen=True)
class CheckpointStats:
    ranks: tuple[RankCheckpointStats, ...] = ()
    committed_step: dict[str, int] = field(default_factory=dict)  # job -> step `latest` names
    persists_ok: int = 0
    persists_failed: int = 0


def collect_stats(
    snapshots: Iterable[Snapshot],
    persisted: dict[RankKey, PersistResult],
    results: list[PersistResult],
    committed_step: Callable[[Snapshot], int | None],
) -> CheckpointStats:
    """Per rank its newest snapshot in memory and its newest persist; per job the step storage
    names (`committed_step` of any of its snapshots: the save directory's `latest`)."""
    committed: dict[str, int] = {}
    newest: dict[RankKey, tuple[int, int, float]] = {}
    for s in snapshots:
        key = RankKey(s.meta.job, s.meta.rank)
        if key not in newest or s.meta.step > newest[key][0]:
            newest[key] = (s.meta.step, s.meta.nbytes, s.header.copy_seconds)
        step = committed_step(s)
        if step is not None:
            committed[s.meta.job] = max(committed.get(s.meta.job, -1), step)
    ranks = []
    for key in sorted(set(newest) | set(persisted), key=lambda k: (k.job, k.rank)):
        mem = newest.get(key)
        p = persisted.get(key)
        ranks.append(
            RankCheckpointStats(
                job=key.job, rank=key.rank,
                memory_step=mem[0] if mem else None,
                memory_bytes=mem[1] if mem else 0,
                last_copy_seconds=mem[2] if mem else 0.0,
                persisted_step=p.step if p else None,
                last_persist_seconds=p.seconds if p else 0.0,
                last_persist_bytes=p.nbytes if p else 0,
            )
        )  # fmt: skip
    return CheckpointStats(
        ranks=tuple(ranks),
        committed_step=committed,
        persists_ok=sum(1 for r in results if r.ok),
        persists_failed=sum(1 for r in results if not r.ok),
    )
