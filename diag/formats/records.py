"""What one op-journal slot holds: the record types shared by the trainer (writer) and the agent.

Everything here is plain data with no torch import, so the agent can read journals without
loading torch.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any


class RecordKind(enum.IntEnum):
    OP = 1  # a collective or point-to-point operation
    STEP = 2  # a training step finished; `step` is the new step count
    PHASE_BEGIN = 3  # a named phase (eval, checkpoint, ...) began; `name` holds it
    PHASE_END = 4
    MARK = 5  # a free-form marker from the trainer (`name`)


class OpState(enum.IntEnum):
    ENQUEUED = 1  # handed to the backend
    STARTED = 2  # the device began it (CUDA start event done)
    COMPLETED = 3
    FAILED = 4

    @property
    def pending(self) -> bool:
        return self in (OpState.ENQUEUED, OpState.STARTED)


class OpCode(enum.IntEnum):
    UNKNOWN = 0
    ALL_REDUCE = 1
    ALL_REDUCE_COALESCED = 2
    BROADCAST = 3
    REDUCE = 4
    ALL_GATHER = 5
    ALL_GATHER_BASE = 6
    ALL_GATHER_COALESCED = 7
    REDUCE_SCATTER = 8
    REDUCE_SCATTER_BASE = 9
    REDUCE_SCATTER_COALESCED = 10
    ALL_TO_ALL = 11
    ALL_TO_ALL_BASE = 12
    GATHER = 13
    SCATTER = 14
    BARRIER = 15
    MONITORED_BARRIER = 16
    SEND = 17
    RECV = 18
    RECV_ANYSOURCE = 19

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def is_p2p(self) -> bool:
        # A set of plain ints: asked once per waiting rank, 128,000 times in a job's analysis.
        return self._value_ in _P2P_CODES


_P2P_CODES = frozenset((OpCode.SEND.value, OpCode.RECV.value, OpCode.RECV_ANYSOURCE.value))
P2P_OPS = frozenset((OpCode.SEND, OpCode.RECV, OpCode.RECV_ANYSOURCE))


class DType(enum.IntEnum):
    NONE = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT32 = 7
    INT64 = 8
    BOOL = 9
    FLOAT8 = 10
    OTHER = 255

    @classmethod
    def from_name(cls, name: str) -> DType:
        """Maps torch dtype names ('torch.float32', 'float32') to our code."""
        short = name.rsplit(".", 1)[-1].upper()
        if short.startswith("FLOAT8"):
            return cls.FLOAT8
        try:
            return cls[short]
        except KeyError:
            return cls.OTHER


class OpFlag(enum.IntFlag):
    NONE = 0
    P2P = 2
    COALESCED = 4
    CUDA = 8  # timed by CUDA events rather than host callbacks


NAME_BYTES = 48

# Slot layout (journal version 2), little-endian, 128 bytes:
#   ver u64 | kind u8 | state u8 | op u16 | dtype u16 | flags u16 | group i32 | peer i32 |
#   group_seq u64 | nbytes u64 | t_enqueue u64 | t_start u64 | t_end u64 | step u64 |
#   name 48s | tid u32 | crc u32
# `ver` is a per-slot seqlock: 2*seq+1 while the writer is changing the slot, 2*seq+2 once the
# slot is consistent. `crc` (zlib.crc32 over the body, seeded with the low 32 bits of seq) catches
# a slot that a dying writer left half-written even if its version word looked settled. `tid` is
# the native id of the thread that issued the record (0: unknown): the training thread, which
# need not be the main one.
# Version 1 had no `tid`: its body ends after `name`, its crc sits at 120, followed by padding.
BODY = struct.Struct("<BBHHHiiQQQQQQ48sI")
SLOT = struct.Struct("<Q" + BODY.format[1:] + "I")
SLOT_SIZE = 128
assert SLOT.size == SLOT_SIZE, SLOT.size
CRC_OFFSET = 8 + BODY.size  # 124
BODY_V1 = struct.Struct("<BBHHHiiQQQQQQ48s")
CRC_OFFSET_V1 = 8 + BODY_V1.size  # 120


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded journal slot. Times are CLOCK_MONOTONIC nanoseconds (0 = not yet)."""

    seq: int  # position in the journal, counting from 0 since the writer started
    kind: RecordKind
    state: OpState
    op: OpCode
    dtype: DType
    flags: OpFlag
    group: int  # index into the journal meta's group table, -1 when none
    peer: int  # global rank of the p2p peer, -1 when none
    group_seq: int  # per-group sequence number of collectives (per-peer for p2p), from 1
    nbytes: int
    t_enqueue_ns: int
    t_start_ns: int
    t_end_ns: int
    step: int
    name: str
    tid: int = 0  # native id of the issuing thread, 0 when unknown (a version 1 journal)

    @property
    def pending(self) -> bool:
        return self.kind == RecordKind.OP and self.state.pending

    def encode_body(self) -> bytes:
        return BODY.pack(
            self.kind,
            self.state,
            self.op,
            self.dtype,
            self.flags,
            self.group,
            self.peer,
            self.group_seq,
            self.nbytes,
            self.t_enqueue_ns,
            self.t_start_ns,
            self.t_end_ns,
            self.step,
            self.name.encode()[:NAME_BYTES],
            self.tid,
        )

    @classmethod
    def decode(cls, seq: int, body: tuple[Any, ...]) -> Record:
        """From a slot's unpacked body (of either journal version). The agent decodes every
        record of every rank: enum members are looked up in plain dicts, which is several times
        cheaper than calling the enum classes."""
        (kind, state, op, dtype, flags, group, peer, gseq, nbytes, t0, t1, t2, step, name) = body[
            :14
        ]
        flag = _FLAGS.get(flags)
        if flag is None:
            flag = _FLAGS[flags] = OpFlag(flags)
        return cls(
            seq=seq,
            kind=_KINDS[kind],
            state=_STATES.get(state, OpState.COMPLETED),
            op=_OPS.get(op, OpCode.UNKNOWN),
            dtype=_DTYPES.get(dtype, DType.OTHER),
            flags=flag,
            group=group,
            peer=peer,
            group_seq=gseq,
            nbytes=nbytes,
            t_enqueue_ns=t0,
            t_start_ns=t1,
            t_end_ns=t2,
            step=step,
            name=name.rstrip(b"\0").decode(errors="replace"),
            tid=body[14] if len(body) > 14 else 0,
        )


_KINDS: dict[int, RecordKind] = {m.value: m for m in RecordKind}
_STATES: dict[int, OpState] = {m.value: m for m in OpState}
_OPS: dict[int, OpCode] = {m.value: m for m in OpCode}
_DTYPES: dict[int, DType] = {m.value: m for m in DType}
_FLAGS: dict[int, OpFlag] = {}
