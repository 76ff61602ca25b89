"""The op journal: a fixed-size mmap ring, one file per rank, one writer, any number of readers.

The trainer appends a slot per operation and rewrites that slot when the operation's state
changes. A reader in another process (the agent) sees every settled slot and never a torn one,
without locks and without the writer's cooperation: it keeps working when the writer is stuck,
holds the GIL forever, or was killed in the middle of a write.

File layout (little-endian):
  [0, 64)       static header: magic, version, sizes, identity (written once)
  [64, 72)      head: number of slots ever claimed; stored after the slot is settled
  [128, 256)    state block under a seqlock: status, step, phase
  [4096, ...)   `capacity` slots of 128 bytes (see records.py)

Version 2 records the native id of the thread that issued each record; readers read version 1
journals too (their records say tid 0), so an agent outlives trainers of the older version.
"""

from __future__ import annotations

import enum
import mmap
import os
import secrets
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from diag.formats.records import (
    BODY,
    BODY_V1,
    CRC_OFFSET,
    CRC_OFFSET_V1,
    NAME_BYTES,
    SLOT_SIZE,
    DType,
    OpCode,
    OpFlag,
    OpState,
    Record,
    RecordKind,
)
from diag.formats.rundir import make_run_dir
from diag.formats.untrusted import Owners, UntrustedInput, open_regular

MAGIC = b"DIAGJRN1"
VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_SIZE = 4096
DEFAULT_CAPACITY = 4096  # 512 KiB of slots per rank
MAX_CAPACITY = 1 << 22  # 512 MiB of slots: far beyond any use, and a bound on what a reader maps
MAX_JOURNAL_BYTES = HEADER_SIZE + MAX_CAPACITY * SLOT_SIZE

_STATIC = struct.Struct("<8sIIIIiiiIIIQQ")  # magic..created_mono_ns
_HEAD_OFF = 64
_U64 = struct.Struct("<Q")
_STATE_OFF = 128
# ver u64 | status u32 | closed_by u32 (was pad) | step u64 | step_ns u64 | reserved u64 | phase 48s |
# phase_ns u64 | crc u32 | pad u32
_STATE = struct.Struct("<QIIQQQ48sQII")
_STATE_CRC_OFF = _STATE.size - 8
_U32 = struct.Struct("<I")
_READ_RETRIES = 64


class JournalStatus(enum.IntEnum):
    RUNNING = 1
    CLOSED = 2  # the writer finished normally
    FAILED = 3  # the writer saw an uncaught exception on its way out


_STATUSES = {int(s): s for s in JournalStatus}


class CloseReason(enum.IntEnum):
    """Where a CLOSED journal was closed: a rank that left its process group while others still
    needed it is told apart from one whose process was ending."""

    UNKNOWN = 0  # not said (a writer of an older version)
    EXIT = 1  # at interpreter exit
    LEFT_GROUP = 2  # when the default process group was destroyed; the process may run on


_REASONS = {int(r): r for r in CloseReason}


class JournalFormatError(Exception):
    """The file is not an op journal this version can read."""


@dataclass(frozen=True)
class JournalHeader:
    capacity: int
    rank: int
    world_size: int
    local_rank: int
    pid: int
    attempt: int
    created_wall_ns: int
    created_mono_ns: int


@dataclass(frozen=True)
class JournalState:
    status: JournalStatus
    step: int  # completed training steps
    step_mono_ns: int  # when the last step completed (0 = none yet)
    phase: str  # the innermost open phase, "" when none
    phase_mono_ns: int  # when it began
    closed_by: CloseReason = CloseReason.UNKNOWN


def _state_bytes(
    ver: int, status: int, step: int, step_ns: int, phase: str, phase_ns: int, closed_by: int = 0
) -> bytes:
    raw = _STATE.pack(
        ver, status, closed_by, step, step_ns, 0, phase.encode()[:NAME_BYTES], phase_ns, 0, 0
    )
    crc = zlib.crc32(raw[8:_STATE_CRC_OFF])
    return raw[:_STATE_CRC_OFF] + struct.pack("<II", crc, 0)


class JournalWriter:
    """Appends records to a journal file. Thread-safe within one process (collective completion
    callbacks arrive on backend threads); only one process may write a given file."""

    def __init__(
        self,
        path: Path,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        attempt: int = 0,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if capacity < 16 or capacity & (capacity - 1):
            raise ValueError(f"journal capacity must be a power of two >= 16, got {capacity}")
        self.path = path
        self.capacity = capacity
        self._mask = capacity - 1
        self._lock = threading.Lock()
        self._head = 0
        self._state_ver = 0
        self._status = JournalStatus.RUNNING
        self._closed_by = CloseReason.UNKNOWN
        self._step = 0
        self._step_ns = 0
        self._phases: list[tuple[str, int]] = []
        # Fields of slots that may still change, so an update can rewrite the whole slot.
        self._live: dict[int, list] = {}
        size = HEADER_SIZE + capacity * SLOT_SIZE
        make_run_dir(path.parent)
        # Build the file under a temp name and rename it into place: a reader either sees the
        # previous incarnation or a fully initialised header. The temp file is created new,
        # never opened through a planted file or symlink (which would truncate its target).
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # Owner-only: the agent runs as the pod's user (or root); nobody else reads what ran.
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        static = _STATIC.pack(
            MAGIC,
            VERSION,
            HEADER_SIZE,
            SLOT_SIZE,
            capacity,
            rank,
            world_size,
            local_rank,
            os.getpid(),
            attempt,
            0,
            time.time_ns(),
            time.monotonic_ns(),
        )
        self._mm[0 : len(static)] = static
        self._write_state()
        os.replace(tmp, path)

    # -- records -----------------------------------------------------------------------------

    def append(
        self,
        kind: RecordKind,
        *,
        state: OpState = OpState.COMPLETED,
        op: OpCode = OpCode.UNKNOWN,
        dtype: DType = DType.NONE,
        flags: OpFlag = OpFlag.NONE,
        group: int = -1,
        peer: int = -1,
        group_seq: int = 0,
        nbytes: int = 0,
        t_enqueue_ns: int = 0,
        t_start_ns: int = 0,
        t_end_ns: int = 0,
        name: str = "",
        live: bool = False,
    ) -> int:
        """Writes a new slot and returns its sequence number. With `live`, the fields are kept
        so that `update` can change the state later."""
        fields = [
            kind,
            state,
            op,
            dtype,
            flags,
            group,
            peer,
            group_seq,
            nbytes,
            t_enqueue_ns,
            t_start_ns,
            t_end_ns,
            self._step,
            name.encode()[:NAME_BYTES],
            threading.get_native_id(),
        ]
        return self._claim(fields, live)

    def append_op(
        self,
        op: OpCode,
        dtype: DType,
        flags: OpFlag,
        group: int,
        peer: int,
        group_seq: int,
        nbytes: int,
        t_enqueue_ns: int,
    ) -> int:
        """An enqueued op, kept live for `update`: `append` without the keyword plumbing, since
        every instrumented collective pays for this call."""
        fields = [RecordKind.OP, OpState.ENQUEUED, op, dtype, flags, group, peer, group_seq]
        fields += [nbytes, t_enqueue_ns, 0, 0, self._step, b"", threading.get_native_id()]
        return self._claim(fields, True)

    def _claim(self, fields: list, live: bool) -> int:
        with self._lock:
            seq = self._head
            self._write_slot(seq, fields)
            self._head = seq + 1
            _U64.pack_into(self._mm, _HEAD_OFF, self._head)
            if live:
                self._live[seq] = fields
                if len(self._live) > self.capacity:
                    # Ops whose completion never came and whose slots the ring has reused.
                    for old in [s for s in self._live if self._head - s > self.capacity]:
                        del self._live[old]
        return seq

    def update(self, seq: int, state: OpState, *, t_start_ns: int = 0, t_end_ns: int = 0) -> None:
        """Moves a live op to a new state. A slot that the ring has since reused is left alone."""
        with self._lock:
            fields = self._live.get(seq)
            if fields is None:
                return
            fields[1] = state
            if t_start_ns:
                fields[10] = t_start_ns
            if t_end_ns:
                fields[11] = t_end_ns
            if self._head - seq <= self.capacity:
                self._write_slot(seq, fields)
            if not state.pending:
                del self._live[seq]

    def _write_slot(self, seq: int, fields: list) -> None:
        mm = self._mm
        off = HEADER_SIZE + (seq & self._mask) * SLOT_SIZE
        body = BODY.pack(*fields)
        _U64.pack_into(mm, off, 2 * seq + 1)  # odd: slot in flux
        mm[off + 8 : off + CRC_OFFSET] = body
        _U32.pack_into(mm, off + CRC_OFFSET, zlib.crc32(body, seq & 0xFFFFFFFF))
        _U64.pack_into(mm, off, 2 * seq + 2)  # even: settled

    # -- training progress -------------------------------------------------------------------

    def step(self, step: int, t_ns: int | None = None) -> None:
        t = t_ns or time.monotonic_ns()
        with self._lock:
            self._step, self._step_ns = step, t
            self._write_state()
        self.append(RecordKind.STEP, t_end_ns=t)

    def phase_begin(self, name: str) -> None:
        t = time.monotonic_ns()
        with self._lock:
            self._phases.append((name, t))
            self._write_state()
        self.append(RecordKind.PHASE_BEGIN, name=name, t_start_ns=t)

    def phase_end(self, name: str) -> None:
        t = time.monotonic_ns()
        with self._lock:
            for i in range(len(self._phases) - 1, -1, -1):
                if self._phases[i][0] == name:
                    del self._phases[i]
                    break
            self._write_state()
        self.append(RecordKind.PHASE_END, name=name, t_end_ns=t)

    def mark(self, name: str) -> None:
        self.append(RecordKind.MARK, name=name, t_end_ns=time.monotonic_ns())

    def close(
        self,
        status: JournalStatus = JournalStatus.CLOSED,
        reason: CloseReason = CloseReason.UNKNOWN,
    ) -> None:
        with self._lock:
            if self._status != JournalStatus.RUNNING:
                return  # the first verdict on how the writer ended stands
            self._status = status
            self._closed_by = reason
            self._write_state()
            self._mm.flush()

    @property
    def closed(self) -> bool:
        return self._status != JournalStatus.RUNNING

    def _write_state(self) -> None:
        phase, phase_ns = self._phases[-1] if self._phases else ("", 0)
        self._state_ver += 1
        odd = 2 * self._state_ver - 1
        data = _state_bytes(
            odd + 1, self._status, self._step, self._step_ns, phase, phase_ns, self._closed_by
        )
        _U64.pack_into(self._mm, _STATE_OFF, odd)
        self._mm[_STATE_OFF + 8 : _STATE_OFF + _STATE.size] = data[8:]
        _U64.pack_into(self._mm, _STATE_OFF, odd + 1)


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
        raw = _STATIC.unpack_from(self._mm, 0)
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
        return _U64.unpack_from(self._mm, _HEAD_OFF)[0]

    def state(self) -> JournalState:
        mm = self._mm
        for _ in range(_READ_RETRIES):
            raw = mm[_STATE_OFF : _STATE_OFF + _STATE.size]
            ver = _U64.unpack_from(raw, 0)[0]
            if ver & 1 or ver == 0:
                time.sleep(0)
                continue
            fields = _STATE.unpack(raw)
            if zlib.crc32(raw[8:_STATE_CRC_OFF]) != fields[8]:
                time.sleep(0)
                continue
            if _U64.unpack_from(mm, _STATE_OFF)[0] != ver:
                continue
            _, status, closed_by, step, step_ns, _, phase, phase_ns, _, _ = fields
            return JournalState(
                # A status this version does not know says nothing: the writer is running.
                status=_STATUSES.get(status, JournalStatus.RUNNING),
                step=step,
                step_mono_ns=step_ns,
                phase=phase.rstrip(b"\0").decode(errors="replace"),
                phase_mono_ns=phase_ns,
                closed_by=_REASONS.get(closed_by, CloseReason.UNKNOWN),
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
            ver = _U64.unpack_from(raw, 0)[0]
            if ver != want:
                if ver == want - 1:  # in flux right now: retry briefly
                    time.sleep(0)
                    continue
                return None
            body = raw[8 : self._crc_off]
            crc = _U32.unpack_from(raw, self._crc_off)[0]
            if zlib.crc32(body, seq & 0xFFFFFFFF) != crc:
                time.sleep(0)
                continue
            if _U64.unpack_from(mm, off)[0] != want:
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
