"""Checkpoint facts the agent exposes (plain data; the metrics module reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
