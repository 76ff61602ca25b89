"""What a rank's flash checkpointer reports of itself (the agent keeps its own figures,
agent.checkpoint.stats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FlashStats:
    """Checkpoint facts of this rank (the agent keeps its own, see agent.checkpoint.stats)."""

    memory_step: int | None = None  # newest complete snapshot in memory
    persisted_step: int | None = None  # newest step the agent acknowledged as on storage
    committed_step: int | None = None  # newest step complete on storage for every rank
    saves: int = 0
    skipped: int = 0  # saves refused because every slot was pinned by a pending persist
    failed_copies: int = 0
    last_save_seconds: float = 0.0  # blocking time of the last save
    last_copy_seconds: float = 0.0  # the copy into shared memory (in the background if async)
    last_save_bytes: int = 0
    last_persist_seconds: float = 0.0
    last_persist_bytes: int = 0
    persist_failures: int = 0
    loaded_from: str = ""  # "memory", "storage" or "" (nothing loaded)
    resharded_from: int | None = None  # data-parallel size of the step loaded, when it differed
    last_reshard_seconds: float = 0.0  # converting it to a universal checkpoint (0: reused)
