"""A slot's description is JSON another process wrote, read by the agent at every scan, persist
and stats call: it is refused unread over a cap that real descriptions stay far below, refused
unparsed when it is made of more objects than a description holds, and parsed once per
generation of the slot, in a bounded cache."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import memprobe
import pytest
from memprobe import MIB
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

import diag.formats.slotmeta as slotmeta
from diag.agent.checkpoint.manager import CheckpointManager
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import FileEntry, SnapshotError, SnapshotMeta, Span

MODEL = "global_step{}/mp_rank_00_model_states.pt"
CAP = 8 * MIB  # slotmeta.MAX_META_BYTES (written out: these tests also ran against older code)


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-descriptions-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _write(run_dir: Path, step: int, job: str = "j") -> SlotFile:
    slot = new_slot(run_dir, job, 0, 0)
    files = captured({MODEL.format(step): model_states(step)})
    write_snapshot(slot, step, files, job=job, rank=0, world=1, save_dir=run_dir / "save")
    return slot


# The probe's child: a slot whose complete snapshot has a description of BLOB bytes of
# `[{},{},...]` (what a writer of the slot could plant), read three times by the agent's manager.
_PLANTED = """
import atexit, json, logging, shutil, tempfile
from pathlib import Path
from diag.agent.checkpoint.manager import CheckpointManager
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import HEADER_SIZE, slot_path

warnings = []

class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())

def setup():
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-descriptions-", dir="/dev/shm"))
    atexit.register(shutil.rmtree, run_dir, True)
    blob = b"[" + b"{}," * ((BLOB - 4) // 3) + b"{}]"  # no list of parts: a low peak here
    slot = SlotFile.create(
        slot_path(run_dir, "j", 0, 0), HEADER_SIZE + len(blob), job="j", rank=0, world_size=1,
        local_rank=0, slot=0, writer_pid=0, writer_start=0.0,
    )
    gen = slot.begin_write()
    slot.mm[HEADER_SIZE : HEADER_SIZE + len(blob)] = blob
    slot.finish_write(gen, 5, HEADER_SIZE, len(blob), 0.0)
    slot.close()
    logging.getLogger().addHandler(Keep(logging.WARNING))
    return CheckpointManager(run_dir, None)

def read(manager):
    try:
        found = [len(manager.snapshots(None)) for _ in range(3)]
    finally:
        manager.close(timeout=10)
    return json.dumps({"found": found, "warnings": warnings})

CASES = {"read": read}
"""


@pytest.mark.parametrize(
    "size",
    [32 * MIB, CAP - 1],
    ids=["32MiB-over-the-cap", "just-under-the-cap"],
)
def test_a_planted_description_costs_the_agent_no_memory(size: int) -> None:
    """A13: 32 MiB of `[{},...]` grew the agent by 771 MiB at every snapshots() call. Over the
    cap it is not even read; under it, its objects are counted before anything is parsed."""
    probe = memprobe.run(f"BLOB = {size}\n" + _PLANTED)["read"]
    assert probe.peak_grew < 48 * MIB, probe
    got = json.loads(probe.outcome)
    assert got["found"] == [0, 0, 0], probe
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "over" in got["warnings"][0] or "objects and lists" in got["warnings"][0], got


def test_an_unchanged_description_is_parsed_once(run_dir: Path, monkeypatch) -> None:
    """A13: every snapshots() call parsed every slot's description again."""
    parsed: list[int] = []
    real = slotmeta.parse_json

    def counting(source, data):  # type: ignore[no-untyped-def]
        parsed.append(len(data))
        return real(source, data)

    monkeypatch.setattr(slotmeta, "parse_json", counting)
    slot = _write(run_dir, 5)
    manager = CheckpointManager(run_dir, None)
    try:
        for _ in range(3):
            assert [s.meta.step for s in manager.snapshots(None)] == [5]
            manager.stats()
        assert len(parsed) == 1, "parsed once, whoever reads it"
        files = captured({MODEL.format(6): model_states(6)})
        write_snapshot(slot, 6, files, job="j", rank=0, world=1, save_dir=run_dir / "save")
        for _ in range(2):
            assert [s.meta.step for s in manager.snapshots(None)] == [6]
        assert len(parsed) == 2, "a new generation is parsed again, once"
    finally:
        slot.close()
        manager.close(timeout=10)


def test_the_description_cache_is_bounded_in_entries_and_bytes() -> None:
    from diag.formats.slotcache import DescriptionCache, Parsed, SlotIdentity

    def _key(n: int, meta_len: int) -> SlotIdentity:
        return SlotIdentity(1, n, 1 << 20, 2, 5, 4096, meta_len, 0.0, 1, 0.0)

    meta = slotmeta.description_from_json(
        SnapshotMeta("j", 0, 1, 0, "n", 5, "global_step5", "/ckpt", ()).to_json()
    )
    cache = DescriptionCache(max_entries=4, max_bytes=10_000)
    for n in range(10):
        cache.put(_key(n, 1000), Parsed(meta))
    assert len(cache) == 4 and cache.get(_key(9, 1000)) is not None
    assert cache.get(_key(0, 1000)) is None, "the oldest went first"
    for n in range(10, 20):
        cache.put(_key(n, 4000), Parsed(meta))
    assert cache.held_bytes <= 10_000 and len(cache) == 2
    cache.put(_key(99, 20_000), Parsed(meta))
    assert cache.get(_key(99, 20_000)) is None, "larger than the whole cache: not kept"


def test_a_refused_description_is_not_parsed_again(run_dir: Path, monkeypatch) -> None:
    parsed: list[int] = []
    real = slotmeta.parse_json
    monkeypatch.setattr(
        slotmeta, "parse_json", lambda s, d: parsed.append(1) or real(s, d)
    )  # fmt: skip
    slot = _write(run_dir, 5)
    h = slot.header()
    blob = json.dumps({"format": "nope"}).encode()
    gen = slot.begin_write()
    slot.mm[h.meta_offset : h.meta_offset + len(blob)] = blob
    slot.finish_write(gen, 5, h.meta_offset, len(blob), 0.0)
    for _ in range(3):
        with pytest.raises(ValueError, match="unsupported snapshot description format"):
            slot.meta()
    assert len(parsed) == 1
    slot.close()


def test_the_trainer_refuses_to_write_a_description_no_reader_accepts() -> None:
    from diag.formats.slotmeta import MAX_META_BYTES
    from diag.trainer.flash import slotlayout

    assert MAX_META_BYTES == CAP
    long = "/".join(["d" * 250] * 16)  # 4,000 characters
    files = tuple(FileEntry(f"{long}/{i}", "raw", data=Span(4096, 0)) for i in range(2200))
    meta = SnapshotMeta("j", 0, 1, 0, "n", 5, "global_step5", "/ckpt", files)
    with pytest.raises(SnapshotError, match="over the"):
        slotlayout.description(meta)
