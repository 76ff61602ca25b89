"""Pure decisions of the flash checkpointer, taken from facts every rank contributes.

- where to resume from: the newest step that *every* rank holds complete in memory, unless the
  storage holds a newer one (a rank killed in the middle of a copy has only its previous step, so
  the ranks agree on that one), and leaving out the steps a rank failed to load from memory;
- which ranks keep a node-local copy of the model-states file so that a restart can load from
  memory on nodes where DeepSpeed writes no model file (ZeRO 1 and 2 write it on data-parallel
  rank 0 only).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Source(enum.Enum):
    MEMORY = "memory"
    STORAGE = "storage"
    NONE = "none"


@dataclass(frozen=True)
class RankFacts:
    rank: int
    memory_steps: tuple[int, ...]  # complete in memory, with every file this rank needs to load
    storage_step: int | None  # the step the storage's `latest` names, as this rank reads it


@dataclass(frozen=True)
class ResumePlan:
    source: Source
    step: int | None
    reason: str


def plan_resume(facts: Sequence[RankFacts], left_out: frozenset[int] = frozenset()) -> ResumePlan:
    """Where every rank resumes from, the same on each (they all decide on the same facts).
    `left_out`: steps some rank could not load from memory (they all left them out together)."""
    if not facts:
        return ResumePlan(Source.NONE, None, "no ranks")
    common = set(facts[0].memory_steps)
    for f in facts[1:]:
        common &= set(f.memory_steps)
    failed = sorted(common & left_out)
    common -= left_out
    storage_steps = {f.storage_step for f in facts}
    storage = None if None in storage_steps else min(storage_steps)  # type: ignore[type-var]
    memory = max(common) if common else None
    lost = f"step {', '.join(map(str, failed))} failed to load from memory; " if failed else ""
    if memory is not None and (storage is None or memory >= storage):
        return ResumePlan(Source.MEMORY, memory, f"{lost}step {memory} is in memory on every rank")
    if storage is not None:
        why = (
            f"memory holds only step {memory}, older than storage"
            if memory is not None
            else "no step is in memory on every rank"
        )
        return ResumePlan(Source.STORAGE, storage, f"{lost}{why}; storage names step {storage}")
    return ResumePlan(Source.NONE, None, f"{lost}no checkpoint in memory or on storage")


@dataclass(frozen=True)
class WriterFacts:
    rank: int
    node: str
    local_rank: int
    mp_rank: int
    writes_model: bool  # DeepSpeed writes this rank's model-states file


def replica_ranks(facts: Sequence[WriterFacts]) -> set[int]:
    """Ranks that keep a node-local copy of the model states: on each node, for each model-parallel
    rank whose model file no local rank writes, the lowest local rank of that mp rank."""
    written = {(f.node, f.mp_rank) for f in facts if f.writes_model}
    chosen: dict[tuple[str, int], WriterFacts] = {}
    for f in facts:
        key = (f.node, f.mp_rank)
        if key in written:
            continue
        best = chosen.get(key)
        if best is None or f.local_rank < best.local_rank:
            chosen[key] = f
    return {f.rank for f in chosen.values()}


def fell_back(plan: ResumePlan, facts: Sequence[RankFacts]) -> bool:
    """The ranks resume from storage (or from nothing) although every rank held a complete
    step in memory (its own, or one its agent pulled from a peer's replica) at least as new as
    the one they resume from, only not the same one. A rank whose memory holds only older steps
    (a replica that trailed a persist) leaves storage the newest step the job has: no fallback."""
    if plan.source == Source.MEMORY or not facts:
        return False
    floor = plan.step if plan.step is not None else -1
    return all(any(s >= floor for s in f.memory_steps) for f in facts)


def held_text(facts: Sequence[RankFacts], most: int = 8) -> str:
    """Which steps each rank held in memory, ranks holding the same steps together:
    "rank 0: 46, 47; rank 1: 45", "ranks 0-7: 46, 47; ranks 8-15: none"."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for f in sorted(facts, key=lambda f: f.rank):
        groups.setdefault(tuple(sorted(f.memory_steps)), []).append(f.rank)
    parts = []
    for steps, ranks in sorted(groups.items(), key=lambda kv: kv[1][0])[:most]:
        shown = ", ".join(map(str, steps[-4:])) if steps else "none"
        if len(steps) > 4:
            shown = "..., " + shown
        parts.append(f"{_ranks_text(ranks)}: {shown}")
    if len(groups) > most:
        parts.append(f"{len(groups) - most} more groups")
    return "; ".join(parts)


def _ranks_text(ranks: list[int]) -> str:
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
