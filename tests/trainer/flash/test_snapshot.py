"""Snapshot slots: the format, the seqlock against a writer killed mid-copy, the locks between
writer and reader, which slot a save goes into, and a full tmpfs."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

import diag.formats.slotmeta as slotmeta
from diag.formats.slotfile import SlotFile, read_snapshots
from diag.formats.snapshot import (
    ShmSpaceError,
    SlotView,
    find_slots,
    parse_slot_name,
    slot_path,
    tag_step,
    write_order,
)
from diag.trainer.flash.slots import RankSlots, SlotOwner


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-snap-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_names_and_tags(tmp_path: Path) -> None:
    p = slot_path(tmp_path, "my job/1", 12, 1)
    assert p.name == "my_job_1-rank00012.snap1"
    n = parse_slot_name(p.name)
    assert n is not None and (n.job, n.rank, n.slot) == ("my_job_1", 12, 1)
    assert parse_slot_name("x-rank00001.journal") is None
    assert tag_step("global_step40") == 40 and tag_step("global_step") is None


def test_complete_snapshot_round_trip(run_dir: Path) -> None:
    slot = new_slot(run_dir, "j", 0, 0)
    assert not slot.header().complete and read_snapshots(find_slots(run_dir, "j")) == []
    files = captured({"global_step3/mp_rank_00_model_states.pt": model_states(3)}, {"s.py": b"#"})
    meta = write_snapshot(slot, 3, files, job="j", rank=0, world=1, save_dir=run_dir / "ck")
    h = slot.header()
    assert h.complete and h.step == 3 and h.gen == 2
    (snap,) = read_snapshots(find_slots(run_dir, "j"))
    assert snap.meta == meta and slotmeta.description_from_json(meta.to_json()) == meta
    raw = snap.meta.file("s.py")
    assert raw is not None and raw.data is not None
    assert bytes(slot.view(raw.data.offset, raw.data.length)) == b"#"
    write_snapshot(slot, 4, files, job="j", rank=0, world=1, save_dir=run_dir / "ck")
    assert slot.header().gen == 4 and slot.header().step == 4
    slot.close()


def _write_then_hang(run_dir: str, ready) -> None:  # type: ignore[no-untyped-def]
    """Child: a complete snapshot of step 1 in slot 0, then stuck in the middle of step 2."""
    slot0 = new_slot(Path(run_dir), "j", 0, 0)
    files = captured({"global_step1/f.pt": model_states(1)})
    write_snapshot(slot0, 1, files, job="j", rank=0, world=1, save_dir=Path(run_dir) / "ck")
    slot1 = new_slot(Path(run_dir), "j", 0, 1)
    assert slot1.try_lock_exclusive()
    slot1.begin_write()
    slot1.mm[4096:8192] = b"x" * 4096  # half a copy
    ready.set()
    time.sleep(600)


@pytest.mark.timeout(60)
def test_writer_killed_mid_copy_leaves_previous_snapshot(run_dir: Path) -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_write_then_hang, args=(str(run_dir), ready))
    child.start()
    try:
        assert ready.wait(30)
        reader = SlotFile.open(slot_path(run_dir, "j", 0, 1))
        assert not reader.lock_shared(0.2), "the writer holds its slot while copying"
        reader.close()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    snaps = read_snapshots(find_slots(run_dir, "j"))
    assert [(s.path.name, s.header.step) for s in snaps] == [("j-rank00000.snap0", 1)]
    torn = SlotFile.open(slot_path(run_dir, "j", 0, 1))
    assert torn.header().torn
    assert torn.lock_shared(1.0), "the kernel released the dead writer's lock"
    torn.close()


def test_locks_exclude_writer_and_reader(run_dir: Path) -> None:
    writer = new_slot(run_dir, "j", 0, 0)
    reader = SlotFile.open(writer.path)
    assert reader.lock_shared(0.1)
    assert not writer.try_lock_exclusive(), "a reader blocks the writer"
    reader.unlock()
    assert writer.try_lock_exclusive()
    assert not reader.lock_shared(0.1), "a writer blocks readers"
    writer.unlock()
    reader.close()
    writer.close()


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        # (gen, step, pinned) per slot
        ([(0, -1, False), (0, -1, False)], [0, 1]),  # fresh: both empty
        ([(2, 5, False), (0, -1, False)], [1]),  # never over the only complete one
        ([(2, 5, False), (2, 6, False)], [0, 1]),  # older first, then the newest
        ([(2, 5, True), (2, 6, False)], [1]),  # a pending persist pins step 5
        ([(2, 5, False), (2, 6, True)], [0]),
        ([(2, 5, True), (2, 6, True)], []),  # both pinned: the save is skipped
        ([(3, 5, False), (2, 4, False)], [0]),  # torn slot first; keep the complete one
        ([(2, 5, False)], [0]),  # a single slot is always overwritten
        ([(2, 5, True)], []),
        ([(2, 7, False), (4, 7, False), (0, -1, False)], [2, 0, 1]),
    ],
)
def test_write_order(slots: list[tuple[int, int, bool]], expected: list[int]) -> None:
    views = [SlotView(i, g, s, p) for i, (g, s, p) in enumerate(slots)]
    assert write_order(views) == expected


def _owner() -> SlotOwner:
    return SlotOwner("j", 0, 1, 0, os.getpid(), 0.0)


def test_rank_slots_skip_pinned_and_reuse(run_dir: Path) -> None:
    slots = RankSlots(run_dir, _owner(), count=2)
    files = captured({"global_step1/f.pt": model_states(1)})
    for step in (1, 2):
        got = slots.acquire(1 << 20)
        assert got is not None
        index, slot = got
        write_snapshot(slot, step, files, job="j", rank=0, world=1, save_dir=run_dir / "ck")
        slot.unlock()
        slots.pin(index, step)
    assert slots.acquire(1 << 20) is None, "both slots wait for a persist"
    slots.unpin_step(1)
    got = slots.acquire(1 << 20)
    assert got is not None and got[1].header().step == 1
    got[1].unlock()
    assert sorted(slots.complete()) == [1, 2]
    again = RankSlots(run_dir, _owner(), count=2)  # a restarted rank adopts its slots
    assert sorted(again.complete()) == [1, 2]
    again.close(remove=False)
    slots.close(remove=True)
    assert find_slots(run_dir) == []


def test_a_resume_discards_newer_snapshots_so_both_slots_stay_in_turn(run_dir: Path) -> None:
    """A rank that finished copying step 81 while its peer was killed copying it: the job
    resumes from 78, the step they share. Left in place, the lone 81 would count as this rank's
    newest for good, every later save would go into the other slot, and a kill in the middle of
    one of those copies would leave the rank only the abandoned 81 (seen in the kill bench)."""

    def save(slots: RankSlots, step: int) -> int:
        got = slots.acquire(1 << 20)
        assert got is not None
        index, slot = got
        files = captured({f"global_step{step}/f.pt": model_states(step)})
        write_snapshot(slot, step, files, job="j", rank=0, world=1, save_dir=run_dir / "ck")
        slot.unlock()
        return index

    slots = RankSlots(run_dir, _owner(), count=2)
    save(slots, 78)
    save(slots, 81)
    assert sorted(slots.complete()) == [78, 81]
    assert slots.discard_newer(78) == [1]
    assert sorted(slots.complete()) == [78]
    # The saves after the resume take turns: the resumed step is kept until a newer one exists.
    assert [save(slots, step) for step in (79, 80, 81, 82)] == [1, 0, 1, 0]
    assert sorted(slots.complete()) == [81, 82]
    # Nothing resumed (no step every rank could load): every snapshot goes.
    assert sorted(slots.discard_newer(None)) == [0, 1]
    assert slots.complete() == {}
    slots.close(remove=True)


@pytest.fixture
def small_tmpfs():
    d = Path(tempfile.mkdtemp(prefix="diag-test-tmpfs-"))
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)]).returncode
    if rc != 0:
        os.rmdir(d)
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
        os.rmdir(d)


def test_too_little_shared_memory_is_a_clear_error(small_tmpfs: Path) -> None:
    slots = RankSlots(small_tmpfs, _owner(), count=2)
    with pytest.raises(ShmSpaceError) as e:
        slots.acquire(3 << 20)  # two slots of 3 MiB do not fit in 4 MiB
    msg = str(e.value)
    assert "GiB" in msg and "medium: Memory" in msg and "sizeLimit" in msg
    assert find_slots(small_tmpfs) == [], "nothing is allocated before the error"
    # Space taken by someone else between the check and the allocation: fallocate says so
    # cleanly (no SIGBUS later in the middle of a copy).
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (2 << 20))
    with pytest.raises(ShmSpaceError):
        new_slot(small_tmpfs, "j", 0, 0).grow(3 << 20)
    filler.unlink()
