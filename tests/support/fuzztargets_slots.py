"""Fuzz targets: flash-checkpoint slot files, as the agent and the trainer read them.

- slot-meta: a snapshot's JSON description, written into a real slot (its data area a real
  snapshot's) and read back through SlotFile.meta;
- slot-file: a whole slot file (header, data, description), opened with SlotFile.open, its
  description read and every span it names viewed.
"""

from __future__ import annotations

from pathlib import Path

from fuzzkit import FuzzTarget
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import SnapshotError
from diag.formats.untrusted import Owners, UntrustedInput

_slots: dict[Path, tuple[SlotFile, int]] = {}  # scratch dir -> (the slot, where its data ends)


def _real_slot(scratch: Path) -> tuple[SlotFile, bytes]:
    """A genuine snapshot (a torch file and a raw file) in a slot under `scratch`."""
    slot = new_slot(scratch, "fuzz", 0, 0)
    files = captured(
        {"global_step5/mp_rank_00_model_states.pt": model_states(5)}, {"zero_to_fp32.py": b"#!"}
    )
    write_snapshot(slot, 5, files, job="fuzz", rank=0, world=1, save_dir=Path("/ckpt"))
    h = slot.header()
    return slot, bytes(slot.mm[h.meta_offset : h.meta_offset + h.meta_len])


def _meta_seeds(scratch: Path) -> list[bytes]:
    old = _slots.pop(scratch, None)
    if old is not None:
        old[0].close()
    slot, meta = _real_slot(scratch)
    _slots[scratch] = (slot, slot.header().meta_offset)
    return [meta]


def _parse_meta(path: Path) -> object:
    slot, data_end = _slots[path.parent]
    data = path.read_bytes()
    if slot.capacity < data_end + len(data):
        slot.grow(data_end + len(data))
    gen = slot.begin_write()
    slot.mm[data_end : data_end + len(data)] = data
    slot.finish_write(gen, 5, data_end, len(data), 0.0)
    reader = SlotFile.open(slot.path, owners=Owners.this_process())
    try:
        return reader.meta()
    finally:
        reader.close()


def _file_seeds(scratch: Path) -> list[bytes]:
    (scratch / "seed").mkdir(exist_ok=True)
    slot, _ = _real_slot(scratch / "seed")
    try:
        return [bytes(slot.mm[: slot.header().used])]
    finally:
        slot.close()


def _parse_file(path: Path) -> object:
    slot = SlotFile.open(path, owners=Owners.this_process())
    try:
        h = slot.header()
        if not h.complete:
            return h
        meta = slot.meta()
        for f in meta.files:
            for span in (f.pickle, f.data):
                if span is not None:
                    slot.view(span.offset, span.length)
            for s in f.storages:
                slot.view(s.offset, s.nbytes)
        return meta
    finally:
        slot.close()


TARGETS = [
    FuzzTarget("slot-meta", _meta_seeds, _parse_meta, json=True, file_name="meta.json"),
    FuzzTarget(
        "slot-file",
        _file_seeds,
        _parse_file,
        refusals=(UntrustedInput, SnapshotError),
        file_name="fuzz-rank00000.snap0",
    ),
]
