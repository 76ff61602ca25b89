"""Where each captured file goes in a slot, and the copy of its bytes into shared memory.

Storages are copied with torch (`Tensor.copy_`, which uses the intra-op threads); CUDA storages
are copied device-to-host, asynchronously, into the slot's mapping registered with CUDA as pinned
memory (pinned.py), and waited for once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from diag.formats.slotmeta import MAX_META_BYTES
from diag.formats.snapshot import (
    HEADER_SIZE,
    FileEntry,
    SnapshotError,
    SnapshotMeta,
    Span,
    StorageEntry,
    align,
)
from diag.trainer.flash.capture import CapturedFile


def plan_layout(files: Sequence[CapturedFile]) -> tuple[list[FileEntry], int]:
    """Entries with offsets for every file, and where the data ends (the description follows)."""
    offset = HEADER_SIZE
    entries = []
    for f in files:
        if f.kind == "raw":
            entries.append(
                FileEntry(f.path, "raw", f.persist, data=Span(offset, len(f.data)), mode=f.mode)
            )
            offset += align(len(f.data))
            continue
        pickled = Span(offset, len(f.pickle))
        offset += align(len(f.pickle))
        storages = []
        for s in f.storages:
            storages.append(StorageEntry(s.key, offset, s.nbytes))
            offset += align(s.nbytes)
        entries.append(
            FileEntry(f.path, "torch", f.persist, pickle=pickled, storages=tuple(storages))
        )
    return entries, offset


def description(meta: SnapshotMeta) -> bytes:
    """The JSON description the slot ends with. One over the readers' cap would be refused by
    the agent and by a restart alike (kept in memory, never persisted nor loaded): the save
    fails here instead, saying so."""
    blob = meta.to_json()
    if len(blob) > MAX_META_BYTES:
        raise SnapshotError(
            f"the description of step {meta.step} takes {len(blob)} bytes ({len(meta.files)} "
            f"files, {sum(len(f.storages) for f in meta.files)} storages), over the "
            f"{MAX_META_BYTES} a slot's reader accepts: flash checkpoints cannot hold this state"
        )
    return blob


def copy_storage(dst: Any, storage: Any, nbytes: int) -> None:
    """Copies the bytes of one storage into `dst`, a uint8 tensor over shared memory. Device
    storages are copied asynchronously on the current stream; the caller synchronizes."""
    import torch

    if nbytes == 0:
        return
    src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))
    dst.copy_(src, non_blocking=src.device.type != "cpu")


def write_files(
    mm: Any, view: Any, files: Sequence[CapturedFile], entries: Sequence[FileEntry]
) -> bool:
    """Writes every file's bytes into the slot (`mm` its mapping, `view` a uint8 tensor over it).
    Returns True when device copies were issued (the caller must synchronize before completing)."""
    device = False
    for f, e in zip(files, entries, strict=True):
        if e.data is not None:
            mm[e.data.offset : e.data.offset + e.data.length] = f.data
            continue
        if e.pickle is not None:
            mm[e.pickle.offset : e.pickle.offset + e.pickle.length] = f.pickle
        for s, se in zip(f.storages, e.storages, strict=True):
            device = device or s.storage.device.type != "cpu"
            copy_storage(view[se.offset : se.offset + se.nbytes], s.storage, s.nbytes)
    return device


def device_of(files: list[CapturedFile]) -> str:
    """The device the captured state lives on ("cpu" when it all does)."""
    for f in files:
        for s in f.storages:
            if s.storage.device.type != "cpu":
                return str(s.storage.device.type)
    return "cpu"
