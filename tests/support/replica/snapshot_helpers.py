"""Writes flash-checkpoint snapshots the way the trainer does, without DeepSpeed: state dicts are
pickled by the trainer's capture code and copied into a real slot file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import SnapshotMeta, slot_path, step_tag
from diag.trainer.flash.capture import CapturedFile, pickle_state, unpickle_state
from diag.trainer.flash.slotlayout import plan_layout, write_files


def captured(files: dict[str, Any], raw: dict[str, bytes] | None = None) -> list[CapturedFile]:
    out = []
    for path, state in files.items():
        data, storages = pickle_state(state)
        out.append(CapturedFile(path, "torch", data, storages))
    for path, data in (raw or {}).items():
        out.append(CapturedFile(path, "raw", data=data, mode=0o755))
    return out


def new_slot(run_dir: Path, job: str, rank: int, slot: int, world: int = 1) -> SlotFile:
    return SlotFile.create(
        slot_path(run_dir, job, rank, slot),
        8 << 20,
        job=job,
        rank=rank,
        world_size=world,
        local_rank=rank,
        slot=slot,
        writer_pid=0,
        writer_start=0.0,
    )


def write_snapshot(
    slot: SlotFile,
    step: int,
    files: list[CapturedFile],
    *,
    job: str,
    rank: int,
    world: int,
    save_dir: Path,
    node: str = "node-a",
    run: str = "",
    replica_round: bool = True,  # as a trainer whose agent replicates marks a round's step
) -> SnapshotMeta:
    import torch

    entries, data_end = plan_layout(files)
    meta = SnapshotMeta(
        job=job, rank=rank, world_size=world, local_rank=rank, node=node, step=step,
        tag=step_tag(step), save_dir=str(save_dir), files=tuple(entries), run=run,
        replica_round=replica_round,
    )  # fmt: skip
    blob = meta.to_json()
    if slot.capacity < data_end + len(blob):
        slot.grow(data_end + len(blob))
    gen = slot.begin_write()
    view = torch.frombuffer(slot.mm, dtype=torch.uint8)
    write_files(slot.mm, view, files, entries)
    del view
    slot.mm[data_end : data_end + len(blob)] = blob
    slot.finish_write(gen, step, data_end, len(blob), 0.0)
    return meta


def write_raw_snapshot(
    slot: SlotFile,
    step: int,
    raw: dict[str, bytes],
    *,
    job: str,
    rank: int,
    world: int,
    save_dir: Path,
    node: str = "node-a",
    run: str = "",
    replica_round: bool = True,  # as a trainer whose agent replicates marks a round's step
) -> SnapshotMeta:
    """write_snapshot for raw files only, without torch (a second or more to import)."""
    entries, data_end = plan_layout(captured({}, raw=raw))
    meta = SnapshotMeta(
        job=job, rank=rank, world_size=world, local_rank=rank, node=node, step=step,
        tag=step_tag(step), save_dir=str(save_dir), files=tuple(entries), run=run,
        replica_round=replica_round,
    )  # fmt: skip
    blob = meta.to_json()
    if slot.capacity < data_end + len(blob):
        slot.grow(data_end + len(blob))
    gen = slot.begin_write()
    for entry, data in zip(entries, raw.values(), strict=True):
        assert entry.data is not None
        slot.mm[entry.data.offset : entry.data.offset + entry.data.length] = data
    slot.mm[data_end : data_end + len(blob)] = blob
    slot.finish_write(gen, step, data_end, len(blob), 0.0)
    return meta


def model_states(step: int, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed + step)
    return {
        "module": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
        },
        "global_steps": step,
        "ds_version": "test",
        "shapes": [torch.Size([64, 32])],
    }


def load_file(slot: SlotFile, index: int = 0) -> Any:
    """The trainer's load of the slot's `index`th file (capture.unpickle_state), with the slot's
    bounds: its storages and its size."""
    entry = slot.meta().files[index]
    assert entry.pickle is not None
    spans = {s.key: s for s in entry.storages}
    view = slot.view(entry.pickle.offset, entry.pickle.length)

    def storage(key: str) -> memoryview:
        return slot.view(spans[key].offset, spans[key].nbytes)

    try:
        return unpickle_state(
            view, storage, storages={k: s.nbytes for k, s in spans.items()}, budget=slot.capacity
        )
    except TypeError as e:  # the trust tests ran against the code before the bounds too
        if "unexpected keyword" not in str(e):
            raise
        return unpickle_state(view, storage)
