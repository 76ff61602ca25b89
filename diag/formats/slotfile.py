"""Slot files of flash-checkpoint snapshots: mapping, the seqlock and locks (room in tmpfs:
shmroom.py).

The format is described in snapshot.py. No torch here: the agent reads slots with this module.

A slot file is input from another process: it is opened without following a symlink or blocking
on a FIFO, must be a regular file owned by a trusted user, and its description is validated
(slotmeta.py). A slot that fails any of it is skipped with one warning naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diag.formats.journalmeta import safe_job_name
from diag.formats.locks import EXCLUSIVE, SHARED, UNLOCK, ofd_lock
from diag.formats.shmroom import space_message
from diag.formats.slotcache import DESCRIPTIONS, SlotIdentity
from diag.formats.slotmeta import MAX_META_BYTES, parse_meta
from diag.formats.snapshot import (
    CLOSED_CLEAN,
    CLOSED_FAILED,
    CLOSED_OFFSET,
    GEN_OFFSET,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    VERSION,
    ShmSpaceError,
    SlotHeader,
    SnapshotError,
    SnapshotMeta,
    align,
    unpack_header,
)
from diag.formats.untrusted import Owners, UntrustedInput, open_regular

log = logging.getLogger(__name__)

MAX_SLOT_BYTES = 1 << 42  # 4 TiB: far above any rank's state, a bound on what we map

# -- one slot file ----------------------------------------------------------------------------------


class SlotFile:
    """A mapped slot file. The trainer creates and writes it; the agent opens it read-only."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, writable: bool) -> None:
        self.path = path
        self.fd = fd
        self.mm = mm
        self.writable = writable
        st = os.fstat(fd)
        self.device, self.inode = st.st_dev, st.st_ino
        self.owner_uid = st.st_uid  # who wrote it: whose save directory it may name
        self._locked = False

    # opening and creating

    @classmethod
    def open(cls, path: Path, *, writable: bool = False, owners: Owners | None = None) -> SlotFile:
        """Opens a slot file: a regular file (no symlink, no FIFO), owned by one of `owners` when
        given. UntrustedInput when it is not one, SnapshotError when it is not a slot."""
        try:
            fd, st = open_regular(
                path, max_bytes=MAX_SLOT_BYTES, owners=owners, flags=os.O_RDWR if writable else 0
            )
        except UntrustedInput as e:
            if e.problem == "does not exist":  # a slot removed meanwhile: not a refusal
                raise FileNotFoundError(errno.ENOENT, "no such slot file", str(path)) from None
            raise
        try:
            size = st.st_size
            if size < HEADER_SIZE:
                raise SnapshotError(f"{path}: too small for a snapshot slot")
            mm = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            )
        except BaseException:
            os.close(fd)
            raise
        slot = cls(path, fd, mm, writable)
        try:
            slot.header()
        except BaseException:
            slot.close()
            raise
        return slot

    @classmethod
    def create(
        cls,
        path: Path,
        capacity: int,
        *,
        job: str,
        rank: int,
        world_size: int,
        local_rank: int,
        slot: int,
        writer_pid: int,
        writer_start: float,
        prefault: bool = False,
    ) -> SlotFile:
        """Creates a new slot file with room for `capacity` bytes in all. The space is reserved up
        front: a full tmpfs fails here with a clear error, never later with SIGBUS.

        The header goes in before the data area is reserved, so a writer killed while reserving
        leaves an empty slot its restart adopts (or the agent removes), not a nameless file. The
        pages are mapped by the first copy into them (each page is zeroed once either way), or
        here with `prefault` (for a slot made ahead of the save that uses it)."""
        capacity = max(align(capacity, 1 << 20), HEADER_SIZE + (1 << 20))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        mm: mmap.mmap | None = None
        try:
            _reserve(fd, path, HEADER_SIZE)
            os.ftruncate(fd, capacity)
            mm = mmap.mmap(fd, capacity, mmap.MAP_SHARED)
            HEADER_STRUCT.pack_into(
                mm, 0, MAGIC, VERSION, HEADER_SIZE, 0, -1, 0, 0, 0, capacity, rank, world_size,
                local_rank, slot, writer_pid, 0, writer_start, 0.0, 0.0,
                safe_job_name(job).encode()[:64],
            )  # fmt: skip
            _reserve(fd, path, capacity, allocated=HEADER_SIZE)
            if prefault:
                prefault_writable(mm)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return cls(path, fd, mm, True)

    def reserve(self) -> None:
        """Reserves every page of the file (an adopted slot: one left sparse by a writer killed
        while reserving, or by anyone, must not SIGBUS in the middle of a copy); ShmSpaceError
        when tmpfs has no room left for the rest. Cheap for a file already allocated."""
        _reserve(self.fd, self.path, self.capacity, allocated=0)

    def prefault(self) -> None:
        """Maps every page writable now, so the next copy runs at memory speed."""
        prefault_writable(self.mm)

    def take_over(self, writer_pid: int, writer_start: float) -> None:
        """A new writer (a restarted rank) adopts an existing slot without touching its data."""
        h = self.header()
        HEADER_STRUCT.pack_into(
            self.mm, 0, MAGIC, VERSION, HEADER_SIZE, h.gen, h.step, h.meta_offset, h.meta_len,
            h.used, h.capacity, h.rank, h.world_size, h.local_rank, h.slot, writer_pid, 0,
            writer_start, h.completed_at, h.copy_seconds, h.job.encode()[:64],
        )  # fmt: skip

    def grow(self, capacity: int) -> None:
        """Makes the slot bigger (the writer holds the lock; the data is about to be replaced)."""
        capacity = align(capacity, 1 << 20)
        if capacity <= self.capacity:
            return
        _reserve(self.fd, self.path, capacity)
        self.mm.close()
        self.mm = mmap.mmap(self.fd, capacity, mmap.MAP_SHARED)
        struct.pack_into("<Q", self.mm, 56, capacity)

    @property
    def capacity(self) -> int:
        return len(self.mm)

    def replaced(self) -> bool:
        """True when the path no longer names this file (removed, or re-created by someone)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    # reading

    def header(self) -> SlotHeader:
        return unpack_header(self.mm)

    def meta(self) -> SnapshotMeta:
        """The validated description of the complete snapshot (UntrustedInput if malformed),
        parsed once per generation of the slot (slotcache.py)."""
        h = self.header()
        if not h.complete:
            raise SnapshotError(f"{self.path}: no complete snapshot (generation {h.gen})")
        if h.meta_len > MAX_META_BYTES:  # refused unread
            raise UntrustedInput(
                self.path, f"snapshot description of {h.meta_len} bytes, over {MAX_META_BYTES}"
            )
        if h.meta_offset < HEADER_SIZE or h.meta_offset + h.meta_len > len(self.mm):
            raise UntrustedInput(self.path, "snapshot description out of bounds")
        source = str(self.path)
        return DESCRIPTIONS.parse(
            SlotIdentity.of(self.device, self.inode, len(self.mm), h),
            source,
            lambda: parse_meta(
                self.mm[h.meta_offset : h.meta_offset + h.meta_len],
                source=source,
                data_end=h.meta_offset,
            ),
            lambda: self.header() == h,  # not rewritten while it was read
        )

    def view(self, offset: int, length: int) -> memoryview:
        if offset < HEADER_SIZE or offset + length > len(self.mm):
            raise SnapshotError(f"{self.path}: span {offset}+{length} out of bounds")
        return memoryview(self.mm)[offset : offset + length]

    # the seqlock

    def begin_write(self) -> int:
        gen = self.header().gen
        gen = gen + 1 if gen % 2 == 0 else gen + 2  # odd: writing
        struct.pack_into("<Q", self.mm, GEN_OFFSET, gen)
        return gen

    def finish_write(
        self, gen: int, step: int, meta_offset: int, meta_len: int, copy_seconds: float
    ) -> None:
        h = self.header()
        HEADER_STRUCT.pack_into(
            self.mm, 0, MAGIC, VERSION, HEADER_SIZE, gen, step, meta_offset, meta_len,
            meta_offset + meta_len, len(self.mm), h.rank, h.world_size, h.local_rank, h.slot,
            h.writer_pid, 0, h.writer_start, time.time(), copy_seconds, h.job.encode()[:64],
        )  # fmt: skip
        struct.pack_into("<Q", self.mm, GEN_OFFSET, gen + 1)  # even: complete, written last

    def mark_closed(self, failed: bool = False) -> None:
        flag = CLOSED_FAILED if failed else CLOSED_CLEAN
        struct.pack_into("<i", self.mm, CLOSED_OFFSET, flag)

    # locks

    def try_lock_exclusive(self) -> bool:
        self._locked = ofd_lock(self.fd, EXCLUSIVE, wait=False)
        return self._locked

    def lock_shared(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for writers to finish (polling: a stuck writer must not
        stall the agent)."""
        deadline = time.monotonic() + timeout
        while True:
            if ofd_lock(self.fd, SHARED, wait=False):
                self._locked = True
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def unlock(self) -> None:
        if self._locked:
            ofd_lock(self.fd, UNLOCK, wait=False)
            self._locked = False

    @contextlib.contextmanager
    def shared(self, timeout: float) -> Iterator[bool]:
        ok = self.lock_shared(timeout)
        try:
            yield ok
        finally:
            if ok:
                self.unlock()

    def close(self) -> None:
        self.unlock()
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python's mmap module before 3.13


def prefault_writable(mm: mmap.mmap) -> None:
    """Faults every page of a shared mapping in, writable, without writing to it, releasing the
    GIL meanwhile (mmap's own MAP_POPULATE holds it for the whole walk, which stalls training
    when a slot is prepared in the background). Best effort: where the kernel cannot, the first
    copy faults the pages in instead."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        anchor = ctypes.c_char.from_buffer(mm)  # holds an export of `mm` while it lives
    except (OSError, TypeError, ValueError):
        return
    try:
        addr = ctypes.addressof(anchor)
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), _MADV_POPULATE_WRITE)
    finally:
        del anchor


def _reserve(fd: int, path: Path, size: int, allocated: int | None = None) -> None:
    """Allocates the pages now (tmpfs reserves memory for them), so that running out of room is an
    error here rather than SIGBUS in the middle of a copy. `allocated`: how much of the file is
    known to be reserved already (default: its size, as when a slot grows)."""
    current = os.fstat(fd).st_size
    done = current if allocated is None else allocated
    if size <= done:
        return
    try:
        os.posix_fallocate(fd, done, size - done)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            if size > current:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, current)
            raise ShmSpaceError(space_message(path.parent, size - done)) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        if size > current:
            os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, as good as it gets


@dataclass(frozen=True)
class Snapshot:
    """A complete snapshot found in a slot file."""

    path: Path
    header: SlotHeader
    meta: SnapshotMeta = field(compare=False)


def run_dir_owners(run_dir: Path) -> Owners:
    """The default trusted writers of slots in `run_dir`: root, this process's user and the run
    directory's owner (the trainer's user where it made the directory)."""
    try:
        return Owners.of(os.geteuid(), os.stat(run_dir).st_uid)
    except OSError:
        return Owners.this_process()


_warned: dict[tuple[str, str], None] = {}
_WARNED_MAX = 4096


def warn_once(path: Path, problem: str) -> None:
    """One warning per slot file and problem (slots are read on every scan)."""
    key = (str(path), problem)
    if key in _warned:
        return
    if len(_warned) >= _WARNED_MAX:
        _warned.clear()
    _warned[key] = None
    log.warning("ignoring snapshot slot %s: %s", path, problem)


def _problem(path: Path, e: Exception) -> str:
    if isinstance(e, UntrustedInput):
        return e.problem if e.path == str(path) else str(e)
    return str(e).removeprefix(f"{path}: ")


def open_slot(path: Path, owners: Owners | None = None) -> SlotFile | None:
    """SlotFile.open for a reader that goes on without it: None (after one warning naming the
    file) when it is not a trusted slot, silently None when it is gone."""
    try:
        return SlotFile.open(path, owners=run_dir_owners(path.parent) if owners is None else owners)
    except FileNotFoundError:
        return None
    except (OSError, SnapshotError, ValueError, struct.error) as e:
        warn_once(path, _problem(path, e))
        return None


def read_snapshots(paths: Sequence[Path], owners: Owners | None = None) -> list[Snapshot]:
    """Complete snapshots of the given slot files. Torn and empty slots are left out silently;
    untrusted or malformed ones with one warning naming the file. `owners`: who may write
    slots (default: run_dir_owners of each slot's directory)."""
    out = []
    for p in paths:
        slot = open_slot(p, owners)
        if slot is None:
            continue
        try:
            h = slot.header()
            if h.complete:
                out.append(Snapshot(p, h, slot.meta()))
        except (SnapshotError, ValueError, struct.error) as e:
            warn_once(p, _problem(p, e))
        finally:
            slot.close()
    return out
