"""One rank's part of a replica: the used bytes of its slot file, sent and received.

A part is received into a new file as a torn slot (the header's generation made odd), its header
and description checked against the manifest (the node, job, rank, slot, step and launch it
claims; sizes and spans inside what was announced), and only then given its even generation
back: the same seqlock marker a rank's own slot carries, so a part cut off by a dead sender or a
dead receiver is torn and never read as a snapshot.
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
import struct
import time
from pathlib import Path

from diag.agent.replica.pace import Pace
from diag.agent.replica.wire import CHUNK, Manifest, Part, recv_exact
from diag.formats.journalmeta import safe_job_name
from diag.formats.shmroom import space_message
from diag.formats.slotfile import SlotFile
from diag.formats.slotmeta import MAX_META_BYTES, parse_meta
from diag.formats.snapshot import (
    GEN_OFFSET,
    HEADER_SIZE,
    ShmSpaceError,
    SlotHeader,
    SnapshotError,
    unpack_header,
)
from diag.formats.untrusted import Owners, UntrustedInput

CAPACITY_OFFSET = 56  # the header's capacity field (snapshot.HEADER_STRUCT)


class PartError(RuntimeError):
    """A local slot could not be sent (rewritten meanwhile, locked too long)."""


def check_header(h: SlotHeader, part: Part, m: Manifest, source: str) -> None:
    def bad(problem: str) -> UntrustedInput:
        return UntrustedInput(source, f"rank {part.rank}'s part: {problem}")

    if not h.complete:
        raise bad(f"not a complete snapshot (generation {h.gen})")
    if (h.rank, h.slot, h.world_size) != (part.rank, part.slot, m.world_size):
        raise bad(
            f"holds rank {h.rank}, slot {h.slot} of world {h.world_size}; the manifest says "
            f"rank {part.rank}, slot {part.slot} of world {m.world_size}"
        )
    if h.step != m.step:
        raise bad(f"holds step {h.step}, the manifest says {m.step}")
    if h.job != safe_job_name(m.job):
        raise bad(f"belongs to job {h.job!r}, not {m.job!r}")
    if h.meta_offset < HEADER_SIZE or h.meta_len > MAX_META_BYTES:
        raise bad("its description lies outside the data")
    if h.meta_offset + h.meta_len != part.nbytes:
        raise bad(f"uses {h.meta_offset + h.meta_len} bytes, {part.nbytes} announced")


def check_meta(data: bytes, h: SlotHeader, part: Part, m: Manifest, source: str) -> None:
    meta = parse_meta(data, source=source, data_end=h.meta_offset)
    claimed = (meta.node, meta.job, meta.rank, meta.step, meta.run, meta.world_size)
    if claimed != (m.node, m.job, part.rank, m.step, m.run, m.world_size):
        raise UntrustedInput(
            source,
            f"rank {part.rank}'s description (node {meta.node!r}, job {meta.job!r}, rank "
            f"{meta.rank}, step {meta.step}, launch {meta.run!r}) does not match the manifest",
        )


def _reserve(fd: int, size: int, where: Path) -> bool:
    """Gives the file its size; True when its blocks are reserved too (writing into a mapping of
    it cannot then fail for want of space: with a sparse file it would kill the process)."""
    try:
        os.posix_fallocate(fd, 0, size)
        return True
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ShmSpaceError(space_message(where, size)) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)
        return False


def _cut(source: str, rank: int) -> UntrustedInput:
    return UntrustedInput(source, f"closed the connection in rank {rank}'s part")


def _recv_mapped(
    sock: socket.socket, fd: int, start: int, end: int, source: str, rank: int
) -> None:
    """Straight from the socket into the file's pages: one copy, not one into a buffer and
    another into the file."""
    with mmap.mmap(fd, end) as mm, memoryview(mm) as view:
        offset = start
        while offset < end:
            want = min(CHUNK, end - offset)
            k = sock.recv_into(view[offset : offset + want], want)
            if k == 0:
                raise _cut(source, rank)
            offset += k


def _recv_copied(
    sock: socket.socket, fd: int, start: int, end: int, source: str, rank: int
) -> None:
    buf = bytearray(min(CHUNK, end - start))
    view = memoryview(buf)
    offset = start
    while offset < end:
        want = min(len(buf), end - offset)
        k = sock.recv_into(view[:want], want)
        if k == 0:
            raise _cut(source, rank)
        done = 0
        while done < k:
            done += os.pwrite(fd, view[done:k], offset + done)
        offset += k


def slot_size(nbytes: int, capacity: int, room: int) -> int:
    """The size an installed part's file gets: its bytes, and of the room its slot had for the
    rank's next snapshots (`capacity`) as much as `room` still allows: one allowance for all the
    parts of a pull, whatever each header claims."""
    return nbytes + min(max(0, capacity - nbytes), max(0, room))


def receive_part(
    sock: socket.socket,
    fd: int,
    part: Part,
    m: Manifest,
    source: str,
    *,
    where: Path,
    room: int | None = None,
) -> int:
    """Reads one part from `sock` into the new file `fd`, checks it, and marks it complete last;
    the file's size. UntrustedInput when it is not the part the manifest announced;
    ShmSpaceError when it does not fit. A held copy (`room` None) gets the part's size; an
    installed slot (one the rank writes into again) also up to `room` bytes of its capacity."""
    head = recv_exact(sock, HEADER_SIZE, source)
    try:
        h = unpack_header(head)
    except (SnapshotError, struct.error) as e:
        raise UntrustedInput(source, f"rank {part.rank}'s part: {e}") from None
    check_header(h, part, m, source)
    size = part.nbytes if room is None else slot_size(part.nbytes, h.capacity, room)
    reserved = _reserve(fd, size, where)
    torn = bytearray(head)
    struct.pack_into("<Q", torn, GEN_OFFSET, h.gen - 1)  # odd: not a snapshot until checked
    if room is not None:  # an installed slot: its header tells its real size
        struct.pack_into("<Q", torn, CAPACITY_OFFSET, size)
    os.pwrite(fd, torn, 0)
    receive = _recv_mapped if reserved else _recv_copied
    receive(sock, fd, HEADER_SIZE, part.nbytes, source, part.rank)
    check_meta(os.pread(fd, h.meta_len, h.meta_offset), h, part, m, source)
    os.pwrite(fd, struct.pack("<Q", h.gen), GEN_OFFSET)  # even: complete, written last
    return size


def send_part(
    sock: socket.socket,
    path: Path,
    part: Part,
    step: int,
    owners: Owners,
    lock_timeout: float,
    pace: Pace | None = None,
) -> None:
    """Sends the used bytes of the slot file at `path`, which must still hold `step`, under a
    shared lock (the rank writes its next snapshot into another slot meanwhile), at most as fast
    as `pace` lets it."""
    try:
        slot = SlotFile.open(path, owners=owners)
    except (OSError, SnapshotError, UntrustedInput) as e:
        raise PartError(f"{path}: {e}") from None
    try:
        if not slot.lock_shared(lock_timeout):
            raise PartError(f"{path} stayed locked by its writer")
        h = slot.header()
        if not h.complete or h.step != step or h.meta_offset + h.meta_len != part.nbytes:
            raise PartError(f"{path} no longer holds step {step}")
        with memoryview(slot.mm) as view:
            if pace is None:
                sock.sendall(view[: part.nbytes])
                return
            for offset in range(0, part.nbytes, CHUNK):
                chunk = view[offset : min(offset + CHUNK, part.nbytes)]
                delay = pace.take(len(chunk), time.monotonic())
                if delay > 0:
                    time.sleep(delay)
                sock.sendall(chunk)
    finally:
        slot.close()


def new_part_file(name: str, dir_fd: int) -> int:
    """A new file for a part, read-write (its description is read back to be checked), never a
    planted file or link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(name, flags, 0o600, dir_fd=dir_fd)
