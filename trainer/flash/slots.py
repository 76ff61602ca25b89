"""This rank's snapshot slots in shared memory: allocated once, reused, grown when the state grows.

Which slot the next snapshot goes into is decided by `collector.snapshot.write_order` (pure);
this module adds the files, the locks and the pins (slots whose persist is still pending).
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

from diag.formats.rundir import make_run_dir
from diag.formats.slotfile import SlotFile, check_space, is_memory_backed
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
        self.slots: list[SlotFile | None] = [self._adopt(p) for p in self.paths]
        self.pins: dict[int, tuple[int, float]] = {}  # slot -> (step, since)
        self.on_unmap: Callable[[int], None] | None = None  # before a slot's mapping goes away
        self._pin_lock = threading.Lock()  # acknowledgements arrive on the control thread
        self._warned_disk = False

    def _adopt(self, path: Path) -> SlotFile | None:
        """Opens a slot left by an earlier attempt of this rank (its snapshot may be loaded)."""
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
        if h.rank != self.owner.rank or h.world_size != self.owner.world_size:
            slot.close()  # another job layout: start afresh
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        slot.take_over(self.owner.pid, self.owner.start_time)
        return slot

    def _create(self, index: int, capacity: int) -> SlotFile:
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
        )

    def ensure(self, size: int) -> None:
        """Creates missing slots, all at once, so that a shortage of room shows at the first save
        rather than at the second; raises ShmSpaceError before anything is allocated."""
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.replaced():
                self._unmap(i)
                slot.close()
                self.slots[i] = None
        missing = [i for i, s in enumerate(self.slots) if s is None]
        if not missing:
            return
        capacity = align(int(size * HEADROOM), 1 << 20)
        make_run_dir(self.run_dir)  # private: a missing run directory is made 0700
        if not self._warned_disk and not is_memory_backed(self.run_dir):
            self._warned_disk = True
            log.warning(
                "diag: %s is not memory-backed (tmpfs); flash checkpoints will be slower there",
                self.run_dir,
            )
        check_space(self.run_dir, capacity * len(missing))
        for i in missing:
            self.slots[i] = self._create(i, capacity)

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
            out.append(SlotView(i, h.gen, h.step, pinned))
        return out

    def acquire(self, size: int) -> tuple[int, SlotFile] | None:
        """An exclusively locked slot with room for `size` bytes, or None when every candidate is
        pinned by a pending persist or being read by the agent."""
        self.ensure(size)
        for index in write_order(self.views(time.monotonic())):
            slot = self.slots[index]
            assert slot is not None
            if not slot.try_lock_exclusive():
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
            return index, slot
        return None

    def pin(self, index: int, step: int) -> None:
        with self._pin_lock:
            self.pins[index] = (step, time.monotonic())

    def unpin_step(self, step: int) -> None:
        with self._pin_lock:
            for index, (pinned, _) in list(self.pins.items()):
                if pinned == step:
                    del self.pins[index]

    def discard_newer(self, step: int | None) -> list[int]:
        """Makes the complete snapshots newer than `step` (the step the job resumed from; None:
        nothing was) torn, so they are written over first: they belong to a timeline the job
        abandoned (a rank that finished copying a step its peers never completed). Kept, such a
        snapshot would count as this rank's newest and pin its slot for good, leaving every
        later save a single slot to go into: a kill in the middle of a copy would then leave
        this rank nothing it can restore. Returns the slots discarded."""
        out = []
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            h = slot.header()
            if not h.complete or (step is not None and h.step <= step):
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
