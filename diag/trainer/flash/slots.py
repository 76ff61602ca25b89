"""This rank's snapshot slots in shared memory: allocated once, reused, grown when the state grows.

Which slot the next snapshot goes into is decided by `formats.snapshot.write_order` (pure);
this module adds the files, the locks and the pins (slots whose persist is still pending).

What a launch pays for its slots, at the first save: a relaunched rank adopts the slots its
previous launch left (validated, reserved and mapped when the checkpointer starts), so its first
save is a plain copy. A fresh rank's first save reserves the pages of every slot (fallocate:
tmpfs takes the memory then, so shared memory that fills up later cannot fail a save, and a
directory too small is an error there, before anything is written), but maps only the slot that
save goes into, its pages faulted in as the copy touches them; the others are mapped writable in
the background from the next step on (`reserve_deferred`), and a save that needs one before that
is done waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diag.formats.journalmeta import safe_job_name
from diag.formats.rundir import make_run_dir
from diag.formats.shmroom import check_space, is_memory_backed
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import SlotView, SnapshotError, align, slot_path, write_order
from diag.formats.untrusted import Owners, UntrustedInput

log = logging.getLogger(__name__)

HEADROOM = 1.02  # a little room for state that grows between saves (e.g. an added param group)
PIN_TIMEOUT_S = 600.0  # a persist never acknowledged stops pinning its slot after this long


@dataclass(frozen=True)
class SlotOwner:
    job: str
    rank: int
    world_size: int
    local_rank: int
    pid: int
    start_time: float


class RankSlots:
    def __init__(self, run_dir: Path, owner: SlotOwner, count: int = 2) -> None:
        if count < 1:
            raise ValueError("a flash checkpointer needs at least one slot")
        self.run_dir = run_dir
        self.owner = owner
        self.paths = [slot_path(run_dir, owner.job, owner.rank, i) for i in range(count)]
        self.slots: list[SlotFile | None] = [self._adopt(i, p) for i, p in enumerate(self.paths)]
        self.pins: dict[int, tuple[int, float]] = {}  # slot -> (step, since)
        # Steps never written over while complete: the replication rounds' (trainer.flash.replicarounds)
        self.keep: frozenset[int] = frozenset()
        self.refusal = ""  # why the last acquire found no slot: what held each one
        self.on_unmap: Callable[[int], None] | None = None  # before a slot's mapping goes away
        self._pin_lock = threading.Lock()  # acknowledgements arrive on the control thread
        self._warned_disk = False
        # Slots to allocate off the save's path: (indexes, capacity), set by the save that found
        # them missing; then the thread allocating them, and what it failed with.
        self._deferred: tuple[list[int], int] | None = None
        self._reserver: threading.Thread | None = None
        self._reserving: frozenset[int] = frozenset()
        self._reserve_error: BaseException | None = None

    def ensure(self, count: int) -> None:
        """At least `count` slots from now on (a rank whose node replicates keeps the rounds'
        steps beside its newest): one left by an earlier launch is adopted, a missing one is made
        by the save that first needs it."""
        for i in range(len(self.paths), count):
            path = slot_path(self.run_dir, self.owner.job, self.owner.rank, i)
            self.paths.append(path)
            self.slots.append(self._adopt(i, path))

    def _adopt(self, index: int, path: Path) -> SlotFile | None:
        """Opens a slot left by an earlier attempt of this rank (its snapshot may be loaded, and
        the next save reuses its memory). The file was written by another process: only one of
        this rank's user, naming this job, rank, world size and slot index, is adopted; its pages
        are reserved (a sparse file would SIGBUS in a copy) and mapped now. Its generation is
        kept as it is: a torn snapshot stays torn, a complete one is offered to the resume plan,
        which checks it against the other ranks' (the same step, the same launch)."""
        try:
            # Only a slot this rank's user (or root) wrote: another user's file under our name
            # is not adopted (its snapshot would be loaded as ours).
            slot = SlotFile.open(path, writable=True, owners=Owners.this_process())
        except FileNotFoundError:
            return None
        except (OSError, SnapshotError, UntrustedInput) as e:
            log.warning("diag: replacing unreadable snapshot slot %s (%s)", path, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        h = slot.header()
        o = self.owner
        job = safe_job_name(o.job).encode()[:64].decode(errors="replace")
        why = ""
        if h.rank != o.rank or h.world_size != o.world_size:
            why = f"rank {h.rank} of {h.world_size}"  # another job layout: start afresh
        elif h.job != job or h.slot != index:
            why = f"job {h.job!r}, slot {h.slot}"
        else:
            try:
                slot.reserve()
            except (OSError, SnapshotError) as e:
                why = str(e)
        if why:
            log.info("diag: replacing snapshot slot %s (%s)", path, why)
            slot.close()
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        slot.take_over(o.pid, o.start_time)
        slot.prefault()
        return slot

    def _create(self, index: int, capacity: int, prefault: bool = False) -> SlotFile:
        o = self.owner
        with contextlib.suppress(FileNotFoundError):
            self.paths[index].unlink()
        return SlotFile.create(
            self.paths[index],
            capacity,
            job=o.job,
            rank=o.rank,
            world_size=o.world_size,
            local_rank=o.local_rank,
            slot=index,
            writer_pid=o.pid,
            writer_start=o.start_time,
            prefault=prefault,
        )

    def _drop_replaced(self) -> None:
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.replaced():
                if i in self._reserving:
                    self.settle()  # its mapping is in use by the background thread
                self._unmap(i)
                slot.close()
                self.slots[i] = None

    def _missing(self, size: int) -> tuple[list[int], int]:
        """The slots not allocated (nor being allocated) and the capacity to give them; raises
        ShmSpaceError, before anything is allocated, when they do not all fit."""
        missing = [i for i, s in enumerate(self.slots) if s is None and i not in self._reserving]
        capacity = align(int(size * HEADROOM), 1 << 20)
        if not missing:
            return missing, capacity
        make_run_dir(self.run_dir)  # private: a missing run directory is made 0700
        if not self._warned_disk and not is_memory_backed(self.run_dir):
            self._warned_disk = True
            log.warning(
                "diag: %s is not memory-backed (tmpfs); flash checkpoints will be slower there",
                self.run_dir,
            )
        check_space(self.run_dir, capacity * len(missing))
        return missing, capacity

    def reserve_deferred(self) -> None:
        """Starts mapping in, in the background, the slots the last save reserved for later."""
        deferred, self._deferred = self._deferred, None
        if deferred is None or self._reserver is not None:
            return
        slots = [(i, s) for i in deferred[0] if (s := self.slots[i]) is not None]
        if not slots:
            return
        self._reserving = frozenset(i for i, _ in slots)
        self._reserver = threading.Thread(
            target=self._reserve,
            args=([s for _, s in slots],),
            name="diag-flash-slots",
            daemon=True,
        )
        self._reserver.start()

    def _reserve(self, slots: list[SlotFile]) -> None:
        try:
            for slot in slots:
                slot.prefault()
        except BaseException as e:  # handed to the save that needs the slot
            self._reserve_error = e

    def settle(self) -> None:
        """Waits for the slots being allocated in the background; raises what that failed with."""
        thread, self._reserver = self._reserver, None
        if thread is not None:
            thread.join()
        self._reserving = frozenset()
        error, self._reserve_error = self._reserve_error, None
        if error is not None:
            raise error

    def views(self, now: float) -> list[SlotView]:
        out = []
        for i, slot in enumerate(self.slots):
            if slot is None:
                out.append(SlotView(i, 0, -1))
                continue
            h = slot.header()
            with self._pin_lock:
                pin = self.pins.get(i)
            pinned = pin is not None and pin[0] == h.step and now - pin[1] < PIN_TIMEOUT_S
            kept = h.complete and h.step in self.keep
            out.append(SlotView(i, h.gen, h.step, pinned or kept))
        return out

    def acquire(self, size: int) -> tuple[int, SlotFile] | None:
        """An exclusively locked slot with room for `size` bytes, or None when every candidate is
        pinned by a pending persist or being read by the agent. A missing slot the snapshot goes
        into is created now, the other missing ones reserved now and mapped by `reserve_deferred`."""
        self._drop_replaced()
        if self._reserve_error is not None:
            self.settle()
        missing, capacity = self._missing(size)
        views = self.views(time.monotonic())
        order = write_order(views)
        busy: list[int] = []
        for index in order:
            if self.slots[index] is None:
                if index in self._reserving:
                    self.settle()
                if self.slots[index] is None:
                    self.slots[index] = self._create(index, capacity)
            elif index in self._reserving:
                self.settle()  # its pages are being mapped in the background
            with contextlib.suppress(ValueError):
                missing.remove(index)
            for other in missing:  # reserved now, mapped in the background later
                if self.slots[other] is None:
                    self.slots[other] = self._create(other, capacity)
            slot = self.slots[index]
            assert slot is not None
            if not slot.try_lock_exclusive():
                busy.append(index)
                continue
            try:
                if slot.capacity < size:
                    self._unmap(index)
                    slot.grow(int(size * HEADROOM))
            except BaseException:
                slot.unlock()
                raise
            with self._pin_lock:
                self.pins.pop(index, None)
            self._deferred = (missing, capacity) if missing else None
            self.refusal = ""
            return index, slot
        self.refusal = _refusal(views, order, busy, self.keep)
        return None

    def pin(self, index: int, step: int) -> None:
        with self._pin_lock:
            self.pins[index] = (step, time.monotonic())

    def unpin_step(self, step: int) -> None:
        with self._pin_lock:
            for index, (pinned, _) in list(self.pins.items()):
                if pinned == step:
                    del self.pins[index]

    def discard(self, step: int) -> list[int]:
        """Makes this rank's complete snapshots of `step` torn: one that failed to load is not
        offered to the next launch again (nor persisted)."""
        return self._discard(lambda s: s == step)

    def discard_newer(self, step: int | None) -> list[int]:
        """Makes the complete snapshots newer than `step` (the step the job resumed from; None:
        nothing was) torn, so they are written over first: they belong to a timeline the job
        abandoned (a rank that finished copying a step its peers never completed). Kept, such a
        snapshot would count as this rank's newest and pin its slot for good, leaving every
        later save a single slot to go into: a kill in the middle of a copy would then leave
        this rank nothing it can restore. Returns the slots discarded."""
        return self._discard(lambda s: step is None or s > step)

    def _discard(self, which: Callable[[int], bool]) -> list[int]:
        out = []
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            h = slot.header()
            if not h.complete or not which(h.step):
                continue
            if not slot.try_lock_exclusive():
                continue  # the agent is reading it: left for the next save to take
            try:
                slot.begin_write()
            finally:
                slot.unlock()
            out.append(i)
        return out

    def _unmap(self, index: int) -> None:
        if self.on_unmap is not None:
            self.on_unmap(index)

    def complete(self) -> dict[int, SlotFile]:
        """step -> slot, for the complete snapshots of this rank."""
        out: dict[int, SlotFile] = {}
        for slot in self.slots:
            if slot is None:
                continue
            h = slot.header()
            if h.complete and (h.step not in out or out[h.step].header().gen < h.gen):
                out[h.step] = slot
        return out

    def close(self, remove: bool, failed: bool = False) -> None:
        self._deferred = None
        with contextlib.suppress(Exception):  # a slot it could not allocate is simply not there
            self.settle()
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            self._unmap(i)
            if remove and not slot.replaced():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slot.path)
            elif not slot.replaced():
                slot.mark_closed(failed)
            slot.close()
            self.slots[i] = None


def _refusal(views: list[SlotView], order: list[int], busy: list[int], keep: frozenset[int]) -> str:
    """What held each slot when no save could take one, for the warning."""
    out = []
    for v in views:
        if v.index in busy:
            why = "read by the agent"
        elif v.complete and v.step in keep:
            why = "kept for a replication round"
        elif v.pinned:
            why = "its persist pending"
        elif v.index not in order:
            why = "the only complete snapshot"
        else:
            why = "free"
        out.append(
            f"slot {v.index}: step {v.step}, {why}" if v.complete else f"slot {v.index}: {why}"
        )
    return "; ".join(out)
