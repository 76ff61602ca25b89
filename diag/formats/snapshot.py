"""Flash-checkpoint snapshots in shared memory: the format the trainer writes and the agent reads.

Each rank owns a few *slot* files (two by default: double buffering) in the run directory, which
is shared by the trainer and the sidecar (/dev/shm/diag, or an emptyDir with medium Memory):

    <run_dir>/<job>-rank<rank:05d>.snap<slot>

A slot file is a 4 KiB header followed by the data area: torch storages as raw bytes (64-byte
aligned), the pickled structure of each checkpoint file (tensors replaced by storage keys, as
torch.save writes it), small raw files, and a JSON description (SnapshotMeta) at the end.

The header's generation counter is a seqlock: the writer makes it odd before touching the data
and even again, with the step stamped, once everything is in place. A writer killed in between
leaves it odd: that slot is torn and is never used. Because the writer only ever overwrites a slot
that does not hold the newest complete snapshot, a kill mid-copy still leaves the previous one.

Writer and readers also exclude each other with open-file-description locks on the slot file
(the kernel drops them when a process dies): the trainer takes an exclusive lock while writing, the
agent a shared one while persisting, and the trainer writes another slot when one is held.

This module has no torch dependency: the agent uses it to read snapshots.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diag.formats.journalmeta import safe_job_name
from diag.formats.untrusted import UntrustedInput, read_bounded

MAGIC = b"DIAGSNAP"
VERSION = 1
HEADER_SIZE = 4096
ALIGN = 64
META_FORMAT = "diag.snapshot/1"
SLOT_SUFFIX = ".snap"
TAG_PREFIX = "global_step"  # DeepSpeed's default checkpoint tag: global_step{N}
LATEST_FILE = "latest"  # DeepSpeed's tag file in the save directory
TRACKER_FILE = "dlrover_latest.txt"  # the step DLRover and ms-swift resume from
LATEST_MAX_BYTES = 4096
_TAG_RE = re.compile(rf"^{TAG_PREFIX}(\d+)$")
_NAME_RE = re.compile(r"^(?P<job>.+)-rank(?P<rank>\d{5})\.snap(?P<slot>\d+)$")

# magic, version, header size, gen, step, meta offset, meta length, used bytes, capacity,
# rank, world size, local rank, slot, writer pid, closed flag, writer start time, completed at
# (unix time), copy seconds, job name.
HEADER_STRUCT = struct.Struct("<8sIIQqQQQQiiiiiiddd64s")
GEN_OFFSET = 16
CLOSED_OFFSET = 84
CLOSED_CLEAN = 1  # the closed flag: the writer closed the slot at a clean exit
CLOSED_FAILED = 2  # ... at an exit after an uncaught exception (the snapshot is for a restart)


class SnapshotError(Exception):
    """A snapshot cannot be written or read; the message says why and what to do."""


class ShmSpaceError(SnapshotError):
    """Not enough room in the shared-memory directory for the snapshot slots."""


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def step_tag(step: int) -> str:
    """The checkpoint tag of a step: DeepSpeed's default naming."""
    return f"{TAG_PREFIX}{step}"


def tag_step(tag: str) -> int | None:
    m = _TAG_RE.match(tag.strip())
    return int(m.group(1)) if m else None


def read_latest_step(save_dir: str | Path) -> int | None:
    """The step DeepSpeed's `latest` file names in `save_dir`, or None (also for a `latest` that
    is a symlink, a FIFO or too big to be a tag)."""
    try:
        data = read_bounded(Path(save_dir, LATEST_FILE), max_bytes=LATEST_MAX_BYTES)
        return tag_step(data.decode())
    except (OSError, UnicodeDecodeError, UntrustedInput):
        return None


def slot_path(run_dir: Path, job: str, rank: int, slot: int) -> Path:
    return run_dir / f"{safe_job_name(job)}-rank{rank:05d}{SLOT_SUFFIX}{slot}"


PULL_SUFFIX = ".replica-pull"
WRITING_SUFFIX = ".storage-writing"


def pull_marker_path(run_dir: Path, job: str) -> Path:
    """Present while the node's agent pulls the job's replica from a peer into the run
    directory: ranks wait for it to go before they look for snapshots (agent.replica)."""
    return run_dir / f".{safe_job_name(job)}{PULL_SUFFIX}"


def writing_marker_path(run_dir: Path, job: str) -> Path:
    """Present while the node's agent writes the job's newest step to storage after its ranks
    stopped (their own snapshots, a lost peer's replica): ranks about to resume from storage wait
    for it to go, so that they resume from that step and not from an older one."""
    return run_dir / f".{safe_job_name(job)}{WRITING_SUFFIX}"


@dataclass(frozen=True)
class SlotName:
    job: str  # the safe job name as it appears in the file name
    rank: int
    slot: int


def parse_slot_name(name: str) -> SlotName | None:
    m = _NAME_RE.match(name)
    if m is None:
        return None
    return SlotName(m["job"], int(m["rank"]), int(m["slot"]))


def find_slots(run_dir: Path, job: str | None = None) -> list[Path]:
    """Slot files in `run_dir` (of one job, or all), sorted by name."""
    if not run_dir.is_dir():
        return []
    pattern = f"{safe_job_name(job)}-rank*{SLOT_SUFFIX}*" if job else f"*-rank*{SLOT_SUFFIX}*"
    return sorted(p for p in run_dir.glob(pattern) if parse_slot_name(p.name) is not None)


@dataclass(frozen=True)
class SlotHeader:
    gen: int
    step: int
    meta_offset: int
    meta_len: int
    used: int
    capacity: int
    rank: int
    world_size: int
    local_rank: int
    slot: int
    writer_pid: int
    closed: bool  # the writer closed the slot at a clean exit
    writer_start: float  # psutil-style create time of the writer process
    completed_at: float  # unix time the snapshot became complete
    copy_seconds: float
    job: str
    failed: bool = False  # the writer closed the slot at an exit after an uncaught exception

    @property
    def complete(self) -> bool:
        return self.gen > 0 and self.gen % 2 == 0

    @property
    def torn(self) -> bool:
        return self.gen % 2 == 1


def unpack_header(buf: bytes | mmap.mmap) -> SlotHeader:
    raw = HEADER_STRUCT.unpack_from(buf, 0)
    if raw[0] != MAGIC:
        raise SnapshotError("not a diag snapshot slot (bad magic)")
    if raw[1] != VERSION:
        raise SnapshotError(f"unsupported snapshot slot version {raw[1]}")
    return SlotHeader(
        gen=raw[3],
        step=raw[4],
        meta_offset=raw[5],
        meta_len=raw[6],
        used=raw[7],
        capacity=raw[8],
        rank=raw[9],
        world_size=raw[10],
        local_rank=raw[11],
        slot=raw[12],
        writer_pid=raw[13],
        closed=raw[14] == CLOSED_CLEAN,
        writer_start=raw[15],
        completed_at=raw[16],
        copy_seconds=raw[17],
        job=raw[18].rstrip(b"\0").decode(errors="replace"),
        failed=raw[14] == CLOSED_FAILED,
    )


# -- the description of a snapshot ------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    offset: int  # from the start of the slot file
    length: int


@dataclass(frozen=True)
class StorageEntry:
    key: str  # the storage key in the pickle (torch.save's numbering)
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    """One file of the checkpoint, relative to the save directory."""

    path: str  # e.g. "global_step10/mp_rank_00_model_states.pt"
    kind: str  # "torch": a torch.save file; "raw": bytes as they are
    persist: bool = True  # False for a node-local replica that another rank persists
    pickle: Span | None = None  # torch: the pickled structure (data.pkl)
    storages: tuple[StorageEntry, ...] = ()
    data: Span | None = None  # raw: the bytes
    # What the trainer asked for, not read back from a slot (the agent picks modes itself).
    mode: int = field(default=0o644, compare=False)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.path.split("/"))

    @property
    def nbytes(self) -> int:
        if self.kind == "raw":
            return self.data.length if self.data else 0
        return sum(s.nbytes for s in self.storages) + (self.pickle.length if self.pickle else 0)


@dataclass(frozen=True)
class SnapshotMeta:
    job: str
    rank: int
    world_size: int
    local_rank: int
    node: str
    step: int
    tag: str
    save_dir: str
    files: tuple[FileEntry, ...]
    device: str = "cpu"
    format: str = META_FORMAT
    run: str = ""  # the trainer launch that took it, the same on every rank of that launch
    # A replication round's step (trainer.flash.replicarounds): the agent sends only these to peers.
    replica_round: bool = False

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def file(self, path: str) -> FileEntry | None:
        for f in self.files:
            if f.path == path:
                return f
        return None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


# -- which slot to write ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotView:
    index: int
    gen: int
    step: int
    pinned: bool = False  # a persist of this slot's step is still pending

    @property
    def complete(self) -> bool:
        return self.gen > 0 and self.gen % 2 == 0


def write_order(slots: Sequence[SlotView]) -> list[int]:
    """The slots a new snapshot may go into, best first (the writer takes the first it can lock).

    Never a slot whose persist is pending; never the newest complete snapshot while it is the only
    complete one (a kill mid-copy must leave a complete snapshot behind), except with a single slot.
    Empty and torn slots come first, then complete ones, oldest first.
    """
    complete = [s for s in slots if s.complete]
    newest = max(complete, key=lambda s: (s.step, s.gen)) if complete else None
    free = [s for s in slots if not s.pinned and s is not newest]
    free.sort(key=lambda s: (s.complete, s.step, s.index))
    order = [s.index for s in free]
    if newest is not None and not newest.pinned and (len(complete) > 1 or len(slots) == 1):
        order.append(newest.index)
    return order
