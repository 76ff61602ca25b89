"""Loading a flash checkpoint back from shared memory, through DeepSpeed's own `load_checkpoint`.

DeepSpeed finds checkpoint files by name (it globs the model-states files and checks that they
exist) and reads them through its checkpoint engine. So we lay out empty placeholder files with
the snapshot's names in a private directory of the run dir, and serve their contents from shared
memory with a loading engine; everything else is DeepSpeed's unchanged logic, for every ZeRO stage.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.collector.meta import safe_job_name
from diag.collector.slotfile import SlotFile, read_snapshots
from diag.collector.snapshot import FileEntry, find_slots, step_tag
from diag.trainer import reshard
from diag.trainer.capture import loading_engine, relative, swapped_engine, unpickle_state

LOAD_LOCK_TIMEOUT_S = 30.0

# relative path -> (slot file holding it, its entry)
FileIndex = dict[str, tuple[Path, FileEntry]]


class RestoreError(RuntimeError):
    pass


@dataclass(frozen=True)
class Place:
    """Who and where this rank is, as far as finding its snapshots goes."""

    run_dir: Path
    job: str
    node: str
    rank: int
    world_size: int
    save_dir: str


def needed_files(engine: Any, save_dir: str, tag: str) -> set[str]:
    """The files DeepSpeed's load_checkpoint reads on this rank, relative to the save dir."""
    needed = {relative(save_dir, engine._get_ckpt_name(save_dir, tag))}
    if engine.zero_optimization():
        if getattr(engine, "zero_elastic_checkpoint", lambda: False)():
            return {"<every rank's optimizer states>"}  # never all on one node
        needed.add(relative(save_dir, engine._get_zero_ckpt_name(save_dir, tag)))
    return needed


def memory_index(place: Place, needed: Callable[[str], set[str]]) -> dict[int, FileIndex]:
    """step -> file index, for the snapshots this rank could load: complete, of this job layout,
    with every file it needs held on this node (its own, or a local rank's)."""
    local = [
        s for s in read_snapshots(find_slots(place.run_dir, place.job))
        if s.meta.node == place.node and s.meta.world_size == place.world_size
        and s.meta.save_dir == place.save_dir
    ]  # fmt: skip
    out: dict[int, FileIndex] = {}
    for step in {s.meta.step for s in local if s.meta.rank == place.rank}:
        index: FileIndex = {}
        # Own files win over node-local copies of the same path.
        for s in sorted(local, key=lambda s: s.meta.rank != place.rank):
            if s.meta.step == step:
                for f in s.meta.files:
                    if f.kind == "torch":
                        index.setdefault(f.path, (s.path, f))
        if needed(step_tag(step)) <= set(index):
            out[step] = index
    return out


def load_from_memory(engine: Any, place: Place, step: int, index: FileIndex) -> tuple[Any, Any]:
    """engine.load_checkpoint of `step`, with the bytes served from shared memory."""
    shadow = place.run_dir / f".{safe_job_name(place.job)}-rank{place.rank:05d}.load"
    shutil.rmtree(shadow, ignore_errors=True)
    opened: dict[Path, SlotFile] = {}
    try:
        for rel, (path, _) in index.items():
            (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
            (shadow / rel).touch()  # DeepSpeed globs and checks names; we serve the bytes
            if path not in opened:
                opened[path] = SlotFile.open(path)
                if not opened[path].lock_shared(LOAD_LOCK_TIMEOUT_S):
                    raise RestoreError(f"{path} stayed locked by a writer")

        def load(rel: str, map_location: Any) -> Any:
            path, entry = index[rel]
            slot = opened[path]
            h = slot.header()
            if not h.complete or h.step != step or entry.pickle is None:
                raise RestoreError(f"{path} no longer holds step {step}")
            spans = {s.key: s for s in entry.storages}
            return unpickle_state(
                slot.view(entry.pickle.offset, entry.pickle.length),
                lambda key: slot.view(spans[key].offset, spans[key].nbytes),
                map_location,
            )

        with swapped_engine(engine, loading_engine(str(shadow), load)), reshard.direct():
            return engine.load_checkpoint(str(shadow), tag=step_tag(step))
    finally:
        for slot in opened.values():
            slot.close()
        shutil.rmtree(shadow, ignore_errors=True)
