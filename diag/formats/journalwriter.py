"""The writing end of an op journal (`journal` has the layout): one process, any thread."""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
import zlib
from pathlib import Path

from diag.formats.journal import (
    DEFAULT_CAPACITY,
    HEAD_OFF,
    HEADER_SIZE,
    MAGIC,
    STATE,
    STATE_OFF,
    STATIC,
    U32,
    U64,
    VERSION,
    CloseReason,
    JournalStatus,
    state_bytes,
)
from diag.formats.records import (
    BODY,
    CRC_OFFSET,
    NAME_BYTES,
    SLOT_SIZE,
    DType,
    OpCode,
    OpFlag,
    OpState,
    RecordKind,
)
from diag.formats.rundir import make_run_dir


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
        static = STATIC.pack(
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
            U64.pack_into(self._mm, HEAD_OFF, self._head)
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
        U64.pack_into(mm, off, 2 * seq + 1)  # odd: slot in flux
        mm[off + 8 : off + CRC_OFFSET] = body
        U32.pack_into(mm, off + CRC_OFFSET, zlib.crc32(body, seq & 0xFFFFFFFF))
        U64.pack_into(mm, off, 2 * seq + 2)  # even: settled

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
        data = state_bytes(
            odd + 1, self._status, self._step, self._step_ns, phase, phase_ns, self._closed_by
        )
        U64.pack_into(self._mm, STATE_OFF, odd)
        self._mm[STATE_OFF + 8 : STATE_OFF + STATE.size] = data[8:]
        U64.pack_into(self._mm, STATE_OFF, odd + 1)
