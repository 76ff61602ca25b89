"""Fuzz targets: flash-checkpoint slot files, as the agent and the trainer read them.

- slot-meta: a snapshot's JSON description, written into a real slot (its data area a real
  snapshot's) and read back through SlotFile.meta;
- slot-file: a whole slot file (header, data, description), opened with SlotFile.open, its
  description read and every span it names viewed;
- slot-pickle-proof: a snapshot file's pickle (a real model-states file with a client state of
  every kind a checkpoint holds), proven as the trainer proves it before loading it
  (unpickler.check_pickle: refused as an UnpicklingError, never another error);
- slot-pickle-load: the same pickles written into a real slot and loaded as the trainer loads
  them: whatever they raise is reported and the slot skipped (restore.stage), so any exception
  is a refusal here; what is checked is that no input hangs or makes the memory grow.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from fuzzkit import FuzzTarget
from snapshot_helpers import captured, load_file, model_states, new_slot, write_snapshot

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


def _client_state() -> dict[str, Any]:
    """What a checkpoint's client state holds besides tensors (DeepSpeed's own and RNG states)."""
    import argparse
    import collections
    import random

    import numpy as np
    import torch

    return {
        "args": argparse.Namespace(lr=0.1), "seen": {1, 2}, "raw": bytearray(b"ab"),
        "steps": range(4), "counts": collections.defaultdict(list, a=[1]),
        "recent": collections.deque([1], maxlen=3), "np_rng": np.random.get_state(),
        "py_rng": random.getstate()[1][:8], "param": torch.nn.Parameter(torch.ones(2)),
        "dtype": np.dtype("f4"), "view": torch.arange(6.0)[1:4],
        "meta": torch.empty(2, device="meta"),
    }  # fmt: skip


_pickles: dict[Path, tuple[SlotFile, list]] = {}  # scratch dir -> (a slot, the seed's storages)


def _pickle_seeds(scratch: Path) -> list[bytes]:
    old = _pickles.pop(scratch, None)
    if old is not None:
        old[0].close()
    (f,) = captured(
        {"global_step5/mp_rank_00_model_states.pt": {**model_states(5), "client": _client_state()}}
    )
    _pickles[scratch] = (new_slot(scratch, "fuzz", 0, 0), f.storages)
    return [f.pickle]


def _prove(path: Path) -> object:
    from diag.trainer.flash.unpickler import check_pickle

    slot, storages = _pickles[path.parent]
    check_pickle(
        path.read_bytes(), storages={s.key: s.nbytes for s in storages}, budget=slot.capacity
    )
    return None


def _load(path: Path) -> object:
    from diag.trainer.flash.capture import CapturedFile

    slot, storages = _pickles[path.parent]
    files = [
        CapturedFile(
            "global_step5/mp_rank_00_model_states.pt", "torch", path.read_bytes(), storages
        )
    ]
    write_snapshot(slot, 5, files, job="fuzz", rank=0, world=1, save_dir=Path("/ckpt"))
    return load_file(slot)


TARGETS = [
    FuzzTarget("slot-meta", _meta_seeds, _parse_meta, json=True, file_name="meta.json"),
    FuzzTarget(
        "slot-file",
        _file_seeds,
        _parse_file,
        refusals=(UntrustedInput, SnapshotError),
        file_name="fuzz-rank00000.snap0",
    ),
    FuzzTarget(
        "slot-pickle-proof",
        _pickle_seeds,
        _prove,
        refusals=(pickle.UnpicklingError,),
        file_name="data.pkl",
    ),
    FuzzTarget(
        "slot-pickle-load", _pickle_seeds, _load, refusals=(Exception,), file_name="data.pkl"
    ),
]
