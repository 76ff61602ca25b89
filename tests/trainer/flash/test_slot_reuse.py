"""What a launch pays for its snapshot slots: a fresh rank allocates at its first save only the
slot that save goes into (the others follow in the background, and a save that needs one waits
for it); a relaunched rank adopts the slots its previous launch left, after checking that they
are its own, and reserves their pages so a copy never meets a hole. The crash-safety rules stay:
a save never overwrites a rank's only complete snapshot, a torn one is never trusted."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from snapshot_helpers import captured, model_states, write_snapshot

from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import HEADER_STRUCT, find_slots, slot_path
from diag.trainer.flash.slots import RankSlots, SlotOwner

MIB = 1 << 20


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-slot-reuse-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _owner(job: str = "j", rank: int = 0, world: int = 1) -> SlotOwner:
    return SlotOwner(job, rank, world, rank, os.getpid(), 0.0)


def _save(slots: RankSlots, step: int, save_dir: Path, *, torn: bool = False) -> int:
    got = slots.acquire(MIB)
    assert got is not None
    index, slot = got
    if torn:  # a writer killed in the middle of its copy
        slot.begin_write()
    else:
        files = captured({f"global_step{step}/f.pt": model_states(step)})
        write_snapshot(slot, step, files, job="j", rank=0, world=1, save_dir=save_dir)
    slot.unlock()
    return index


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_first_save_reserves_every_slot_and_the_rest_are_mapped_in_the_background(
    run_dir: Path,
) -> None:
    slots = RankSlots(run_dir, _owner(), count=3)
    assert _save(slots, 1, run_dir / "ck") == 0
    for settled in (False, True):
        paths = find_slots(run_dir)
        assert len(paths) == 3, "every slot's pages are taken at the first save"
        for p in paths[1:]:
            slot = SlotFile.open(p)
            h = slot.header()
            assert (h.gen, h.step, h.slot) == (0, -1, int(p.name[-1])), "empty until written"
            assert _allocated(p) >= slot.capacity, "reserved: a copy into it never meets a hole"
            slot.close()
        if not settled:
            slots.reserve_deferred()
            slots.settle()
    assert [_save(slots, s, run_dir / "ck") for s in (2, 3, 4)] == [1, 2, 0]
    slots.close(remove=True)
    assert find_slots(run_dir) == []


def test_a_save_waits_for_a_slot_being_allocated_rather_than_overwrite_its_only_snapshot(
    run_dir: Path,
) -> None:
    slots = RankSlots(run_dir, _owner(), count=2)
    assert _save(slots, 1, run_dir / "ck") == 0
    slots.reserve_deferred()  # no settle: the next save finds slot 1 being allocated (or done)
    assert _save(slots, 2, run_dir / "ck", torn=True) == 1, "never slot 0, the only complete one"
    assert sorted(slots.complete()) == [1]
    slots.close(remove=True)


def test_a_save_without_the_background_allocation_creates_the_slot_itself(run_dir: Path) -> None:
    slots = RankSlots(run_dir, _owner(), count=2)
    assert [_save(slots, s, run_dir / "ck") for s in (1, 2, 3)] == [0, 1, 0]
    slots.reserve_deferred()  # nothing left to allocate
    slots.settle()
    assert sorted(slots.complete()) == [2, 3]
    slots.close(remove=True)


def test_a_relaunch_adopts_its_slots_and_keeps_their_markers(run_dir: Path) -> None:
    first = RankSlots(run_dir, _owner(), count=2)
    _save(first, 7, run_dir / "ck")
    _save(first, 8, run_dir / "ck", torn=True)  # killed copying step 8
    first.close(remove=False)
    inodes = [os.stat(p).st_ino for p in find_slots(run_dir)]
    again = RankSlots(run_dir, _owner(), count=2)
    assert [os.stat(p).st_ino for p in find_slots(run_dir)] == inodes, "the same memory, reused"
    assert sorted(again.complete()) == [7], "the torn slot is not trusted"
    assert _save(again, 8, run_dir / "ck") == 1, "the first save goes into the torn slot"
    assert [os.stat(p).st_ino for p in find_slots(run_dir)] == inodes
    again.close(remove=True)


def _plant(run_dir: Path, index: int, *, job: str = "j", rank: int = 0, world: int = 1,
           slot: int | None = None) -> Path:  # fmt: skip
    path = slot_path(run_dir, "j", 0, index)
    SlotFile.create(
        path, 2 * MIB, job=job, rank=rank, world_size=world, local_rank=rank,
        slot=index if slot is None else slot, writer_pid=1, writer_start=0.0,
    ).close()  # fmt: skip
    return path


@pytest.mark.parametrize(
    "planted",
    [
        {"job": "other"},  # another job's slot under this job's name
        {"slot": 1},  # slot 1's file where slot 0 should be
        {"rank": 1, "world": 2},  # another layout
    ],
)
def test_a_slot_not_this_ranks_own_is_replaced_not_adopted(run_dir: Path, planted: dict) -> None:
    path = _plant(run_dir, 0, **planted)
    inode = os.stat(path).st_ino
    slots = RankSlots(run_dir, _owner(), count=2)
    assert slots.slots[0] is None and not path.exists()
    assert _save(slots, 1, run_dir / "ck") == 0
    assert os.stat(path).st_ino != inode
    slots.close(remove=True)


def test_an_adopted_sparse_slot_is_reserved_before_use(run_dir: Path) -> None:
    """A writer killed while reserving its slot leaves the file sparse (its header written
    first); whoever adopts it reserves the rest, so no copy meets a hole (SIGBUS on a full
    tmpfs)."""
    path = slot_path(run_dir, "j", 0, 0)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 8 * MIB)
    header = HEADER_STRUCT.pack(
        b"DIAGSNAP", 1, 4096, 0, -1, 0, 0, 0, 8 * MIB, 0, 1, 0, 0, 1, 0, 0.0, 0.0, 0.0, b"j"
    )
    os.pwrite(fd, header, 0)
    os.close(fd)
    assert _allocated(path) < MIB
    slots = RankSlots(run_dir, _owner(), count=1)
    assert slots.slots[0] is not None and _allocated(path) >= 8 * MIB
    slots.close(remove=True)


@pytest.fixture
def small_tmpfs():
    d = Path(tempfile.mkdtemp(prefix="diag-test-tmpfs-"))
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)]).returncode
    if rc != 0:
        os.rmdir(d)
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
        os.rmdir(d)


def test_shared_memory_taken_after_the_first_save_fails_no_later_save(
    small_tmpfs: Path,
) -> None:
    slots = RankSlots(small_tmpfs, _owner(), count=2)
    assert _save(slots, 1, small_tmpfs / "ck") == 0  # 2 MiB, and the other slot's pages taken
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):  # someone else takes the rest
        while True:
            f.write(b"\1" * MIB)
            f.flush()
    slots.reserve_deferred()
    assert [_save(slots, s, small_tmpfs / "ck") for s in (2, 3)] == [1, 0]
    slots.close(remove=True)
    filler.unlink()
