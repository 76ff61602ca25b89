"""The reading end of an op journal (`journal` has the layout): any process, never blocking the
writer, never trusting the file."""

from __future__ import annotations

import mmap
import os
import stat
import time
import zlib
from pathlib import Path

from diag.formats.journal import (
    HEAD_OFF,
    HEADER_SIZE,
    MAGIC,
    MAX_CAPACITY,
    MAX_JOURNAL_BYTES,
    READ_RETRIES,
    READABLE_VERSIONS,
    REASONS,
    STATE,
    STATE_CRC_OFF,
    STATE_OFF,
    STATIC,
    STATUSES,
    U32,
    U64,
    CloseReason,
    JournalFormatError,
    JournalHeader,
    JournalState,
    JournalStatus,
)
from diag.formats.records import BODY, BODY_V1, CRC_OFFSET, CRC_OFFSET_V1, SLOT_SIZE, Record
from diag.formats.untrusted import Owners, UntrustedInput, open_regular


class JournalReader:
    """Reads a journal another process writes. Never blocks the writer, never returns a torn
    record; records being rewritten at the moment of the read are reported as missing."""

    def __init__(self, path: Path, *, owners: Owners | None = None) -> None:
        """Opens `path` as another process's journal: a regular file (never a FIFO, which would
        block, nor a symlink), owned by one of `owners` when given, with a sane header. Anything
        else is a JournalFormatError naming the file."""
        self.path = path
        try:
            fd, st = open_regular(path, max_bytes=MAX_JOURNAL_BYTES, owners=owners)
        except UntrustedInput as e:
            raise JournalFormatError(f"cannot open journal {e.path}: {e.problem}") from None
        try:
            self.inode = (st.st_dev, st.st_ino)
            if st.st_size < HEADER_SIZE:
                raise JournalFormatError(
                    f"{path} is {st.st_size} bytes, too small for an op journal"
                )
            self._mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        raw = STATIC.unpack_from(self._mm, 0)
        magic, version, hsize, ssize, cap = raw[:5]
        if magic != MAGIC:
            self.close()
            raise JournalFormatError(f"{path} is not an op journal (bad magic {magic!r})")
        if version not in READABLE_VERSIONS or hsize != HEADER_SIZE or ssize != SLOT_SIZE:
            self.close()
            readable = " and ".join(map(str, READABLE_VERSIONS))
            raise JournalFormatError(
                f"{path}: journal version {version} (header {hsize}, slot {ssize}) is not "
                f"supported by this diag (it reads versions {readable}); upgrade the agent or the "
                "trainer so that both run the same diag"
            )
        self.version = version
        self._body, self._crc_off = (BODY_V1, CRC_OFFSET_V1) if version == 1 else (BODY, CRC_OFFSET)
        # Slots are found by `seq & (capacity - 1)`: only a power of two keeps them in the file.
        if not 16 <= cap <= MAX_CAPACITY or cap & (cap - 1):
            self.close()
            raise JournalFormatError(f"{path}: capacity {cap} is not a power of two in [16, 2^22]")
        if st.st_size < HEADER_SIZE + cap * SLOT_SIZE:
            self.close()
            raise JournalFormatError(f"{path} is truncated: {st.st_size} bytes for {cap} slots")
        self.header = JournalHeader(
            capacity=cap,
            rank=raw[5],
            world_size=raw[6],
            local_rank=raw[7],
            pid=raw[8],
            attempt=raw[9],
            created_wall_ns=raw[11],
            created_mono_ns=raw[12],
        )
        self._mask = cap - 1

    def close(self) -> None:
        self._mm.close()

    def replaced(self) -> bool:
        """True when the path now names another file (a restarted rank made a new journal)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.inode or not stat.S_ISREG(st.st_mode)

    def head(self) -> int:
        return U64.unpack_from(self._mm, HEAD_OFF)[0]

    def state(self) -> JournalState:
        mm = self._mm
        for _ in range(READ_RETRIES):
            raw = mm[STATE_OFF : STATE_OFF + STATE.size]
            ver = U64.unpack_from(raw, 0)[0]
            if ver & 1 or ver == 0:
                time.sleep(0)
                continue
            fields = STATE.unpack(raw)
            if zlib.crc32(raw[8:STATE_CRC_OFF]) != fields[8]:
                time.sleep(0)
                continue
            if U64.unpack_from(mm, STATE_OFF)[0] != ver:
                continue
            _, status, closed_by, step, step_ns, _, phase, phase_ns, _, _ = fields
            return JournalState(
                # A status this version does not know says nothing: the writer is running.
                status=STATUSES.get(status, JournalStatus.RUNNING),
                step=step,
                step_mono_ns=step_ns,
                phase=phase.rstrip(b"\0").decode(errors="replace"),
                phase_mono_ns=phase_ns,
                closed_by=REASONS.get(closed_by, CloseReason.UNKNOWN),
            )
        # The writer died between the two version stores of the state block: what it was
        # writing is lost, and the process is gone or wedged, so report it as running.
        return JournalState(JournalStatus.RUNNING, 0, 0, "", 0)

    def read(self, seq: int) -> Record | None:
        """The record with sequence number `seq`, or None when it was overwritten, is not
        written yet, or is being rewritten right now."""
        mm = self._mm
        off = HEADER_SIZE + (seq & self._mask) * SLOT_SIZE
        want = 2 * seq + 2
        for _ in range(3):
            raw = mm[off : off + SLOT_SIZE]
            ver = U64.unpack_from(raw, 0)[0]
            if ver != want:
                if ver == want - 1:  # in flux right now: retry briefly
                    time.sleep(0)
                    continue
                return None
            body = raw[8 : self._crc_off]
            crc = U32.unpack_from(raw, self._crc_off)[0]
            if zlib.crc32(body, seq & 0xFFFFFFFF) != crc:
                time.sleep(0)
                continue
            if U64.unpack_from(mm, off)[0] != want:
                continue
            try:
                return Record.decode(seq, self._body.unpack(body))
            except (KeyError, ValueError):
                return None  # a record kind this version does not know: not ours to read
        return None

    def read_range(self, start: int, end: int) -> list[Record]:
        """Settled records with start <= seq < end that are still in the ring."""
        start = max(start, end - self.header.capacity, 0)
        out = []
        for seq in range(start, end):
            rec = self.read(seq)
            if rec is not None:
                out.append(rec)
        return out

    def tail(self, n: int) -> list[Record]:
        head = self.head()
        return self.read_range(head - n, head)
