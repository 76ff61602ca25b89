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

This module holds the layout and the types; `journalwriter` and `journalreader` the two ends.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

from diag.formats.records import NAME_BYTES, SLOT_SIZE

MAGIC = b"DIAGJRN1"
VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_SIZE = 4096
DEFAULT_CAPACITY = 4096  # 512 KiB of slots per rank
MAX_CAPACITY = 1 << 22  # 512 MiB of slots: far beyond any use, and a bound on what a reader maps
MAX_JOURNAL_BYTES = HEADER_SIZE + MAX_CAPACITY * SLOT_SIZE

STATIC = struct.Struct("<8sIIIIiiiIIIQQ")  # magic..created_mono_ns
HEAD_OFF = 64
U64 = struct.Struct("<Q")
STATE_OFF = 128
# ver u64 | status u32 | closed_by u32 (was pad) | step u64 | step_ns u64 | reserved u64 | phase 48s |
# phase_ns u64 | crc u32 | pad u32
STATE = struct.Struct("<QIIQQQ48sQII")
STATE_CRC_OFF = STATE.size - 8
U32 = struct.Struct("<I")
READ_RETRIES = 64


class JournalStatus(enum.IntEnum):
    RUNNING = 1
    CLOSED = 2  # the writer finished normally
    FAILED = 3  # the writer saw an uncaught exception on its way out


STATUSES = {int(s): s for s in JournalStatus}


class CloseReason(enum.IntEnum):
    """Where a CLOSED journal was closed: a rank that left its process group while others still
    needed it is told apart from one whose process was ending."""

    UNKNOWN = 0  # not said (a writer of an older version)
    EXIT = 1  # at interpreter exit
    LEFT_GROUP = 2  # when the default process group was destroyed; the process may run on


REASONS = {int(r): r for r in CloseReason}


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


def state_bytes(
    ver: int, status: int, step: int, step_ns: int, phase: str, phase_ns: int, closed_by: int = 0
) -> bytes:
    raw = STATE.pack(
        ver, status, closed_by, step, step_ns, 0, phase.encode()[:NAME_BYTES], phase_ns, 0, 0
    )
    crc = zlib.crc32(raw[8:STATE_CRC_OFF])
    return raw[:STATE_CRC_OFF] + struct.pack("<II", crc, 0)
