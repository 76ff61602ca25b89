"""The journal's companion file: who wrote it and which process groups its records refer to.

The binary ring holds only hot data; everything static (identity, group membership) lives in a
small JSON file next to it, replaced atomically (write to a temp name, rename) so a reader never
sees half of it.
"""

from __future__ import annotations

import builtins
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diag.formats.untrusted import (
    MIB,
    Owners,
    UntrustedInput,
    bounded_int,
    parse_json,
    printable,
    read_bounded,
    write_file_nofollow,
)

META_VERSION = 1
JOURNAL_SUFFIX = ".journal"
META_SUFFIX = ".meta.json"
# Bounds of what a meta may claim: far above any real job, low enough that nothing read from one
# costs much. A meta lists every group's ranks; a few MiB hold tens of thousands of ranks.
META_MAX_BYTES = 8 * MIB
MAX_WORLD = 1 << 20
MAX_GROUPS = 1 << 16
MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT
MAX_TEXT = 1024
MAX_SECONDS = 1e9
MAX_EPOCH = 1e11  # seconds since 1970: a start time beyond the year 5000 is no start time


@dataclass(frozen=True)
class GroupInfo:
    index: int  # what records store in their `group` field
    name: str  # torch's group name; identical on every member rank
    ranks: tuple[int, ...]  # global ranks of the members, in group-rank order
    backend: str = ""
    desc: str = ""
    timeout_s: float = 0.0  # torch's collective timeout for this group, 0 if unknown

    def group_rank_to_global(self, group_rank: int) -> int:
        return self.ranks[group_rank] if 0 <= group_rank < len(self.ranks) else -1


@dataclass(frozen=True)
class JournalMeta:
    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pid: int
    pid_start_time: float  # psutil-style create time: tells a reused PID apart
    node: str
    attempt: int = 0  # restart count of the launcher (TORCHELASTIC_RESTART_COUNT)
    run_id: str = ""
    launcher: str = ""
    device: str = "cpu"
    pg_timeout_s: float = 0.0  # the collective timeout of the default group, 0 if unknown
    groups: tuple[GroupInfo, ...] = field(default_factory=tuple)
    version: int = META_VERSION
    pid_ns: int = 0  # inode of the writer's PID namespace (rundir.pid_namespace), 0 if unknown
    # Native ids of threads diag runs in this process whose stacks do not say so (the control
    # channel's gRPC poller): stack merges class them as diag's, not as the job's RPC.
    own_threads: tuple[int, ...] = ()

    def group(self, index: int) -> GroupInfo | None:
        for g in self.groups:
            if g.index == index:
                return g
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, source: str | Path = "journal meta") -> JournalMeta:
        """Parses what a trainer wrote, checking every field's type and range; anything else is
        an UntrustedInput naming `source`."""
        raw = parse_json(source, text.encode() if isinstance(text, str) else text)
        return _MetaFields(str(source)).meta(raw)


class _MetaFields:
    """Reads the fields of one parsed meta, each into its type and range.

    Its methods `int` and `float` hide the built-in types in annotations inside the class, which
    therefore spell them `builtins.int` and `builtins.float`."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, problem: str) -> UntrustedInput:
        return UntrustedInput(self.source, problem)

    def get(self, raw: dict, key: str, default: object = ...) -> object:
        if key in raw:
            return raw[key]
        if default is ...:
            raise self.fail(f"field {key!r} is missing")
        return default

    def int(
        self, raw: dict, key: str, lo: builtins.int, hi: builtins.int, default: object = ...
    ) -> builtins.int:
        value = self.get(raw, key, default)
        return bounded_int(value, lo=lo, hi=hi, what=f"field {key!r}", source=self.source)

    def float(
        self, raw: dict, key: str, default: object = ..., hi: builtins.float = MAX_SECONDS
    ) -> builtins.float:
        value = self.get(raw, key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"field {key!r} must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or not 0 <= value <= hi:
            raise self.fail(f"field {key!r} {value} is out of range")
        return float(value)

    def text(self, raw: dict, key: str, default: object = ...) -> str:
        value = self.get(raw, key, default)
        if not isinstance(value, str):
            raise self.fail(f"field {key!r} must be a string, got {type(value).__name__}")
        if len(value) > MAX_TEXT:
            raise self.fail(f"field {key!r} is {len(value)} characters, over {MAX_TEXT}")
        return printable(value, keep_newlines=False)

    def items(self, raw: dict, key: str, limit: builtins.int) -> list:
        value = self.get(raw, key, [])
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(f"field {key!r} must be a list, got {type(value).__name__}")
        if len(value) > limit:
            raise self.fail(f"field {key!r} has {len(value)} entries, over {limit}")
        return value

    def group(self, raw: object, world: builtins.int) -> GroupInfo:
        if not isinstance(raw, dict):
            raise self.fail(f"a group must be an object, got {type(raw).__name__}")
        ranks = self.items(raw, "ranks", world)
        what = "a rank of group " + repr(raw.get("name"))
        return GroupInfo(
            index=self.int(raw, "index", 0, 2**31 - 1),
            name=self.text(raw, "name"),
            ranks=tuple(
                bounded_int(r, lo=0, hi=MAX_WORLD - 1, what=what, source=self.source) for r in ranks
            ),
            backend=self.text(raw, "backend", ""),
            desc=self.text(raw, "desc", ""),
            timeout_s=self.float(raw, "timeout_s", 0.0),
        )

    def meta(self, raw: object) -> JournalMeta:
        if not isinstance(raw, dict):
            raise self.fail(f"a journal meta is a JSON object, got {type(raw).__name__}")
        version = raw.get("version")
        if version != META_VERSION or isinstance(version, bool):
            raise self.fail(f"unsupported journal meta version {version!r}")
        world = self.int(raw, "world_size", 1, MAX_WORLD)
        rank = self.int(raw, "rank", 0, world - 1)
        groups = tuple(self.group(g, world) for g in self.items(raw, "groups", MAX_GROUPS))
        own = self.items(raw, "own_threads", 4096)
        return JournalMeta(
            job=self.text(raw, "job"),
            rank=rank,
            world_size=world,
            local_rank=self.int(raw, "local_rank", -1, MAX_WORLD - 1),
            local_world_size=self.int(raw, "local_world_size", 0, MAX_WORLD),
            pid=self.int(raw, "pid", 1, MAX_PID),
            pid_start_time=self.float(raw, "pid_start_time", hi=MAX_EPOCH),
            node=self.text(raw, "node"),
            attempt=self.int(raw, "attempt", 0, 2**31 - 1, 0),
            run_id=self.text(raw, "run_id", ""),
            launcher=self.text(raw, "launcher", ""),
            device=self.text(raw, "device", "cpu"),
            pg_timeout_s=self.float(raw, "pg_timeout_s", 0.0),
            groups=groups,
            version=META_VERSION,
            pid_ns=self.int(raw, "pid_ns", 0, 2**64 - 1, 0),
            own_threads=tuple(
                bounded_int(t, lo=1, hi=MAX_PID, what="a thread id", source=self.source)
                for t in own
            ),
        )


def safe_job_name(job: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", job).strip("._")
    return cleaned[:64] or "job"


def journal_path(run_dir: Path, job: str, rank: int) -> Path:
    return run_dir / f"{safe_job_name(job)}-rank{rank:05d}{JOURNAL_SUFFIX}"


def meta_path_for(journal: Path) -> Path:
    return journal.with_name(journal.name[: -len(JOURNAL_SUFFIX)] + META_SUFFIX)


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` so that readers see either the old file or the whole new one, following
    no symlink planted at the temp name, the final name or the directory (owner-only)."""
    write_file_nofollow(path, data, mode=0o600)


def write_meta(journal: Path, meta: JournalMeta) -> None:
    write_atomic(meta_path_for(journal), meta.to_json().encode())


def read_meta(journal: Path, owners: Owners | None = None) -> JournalMeta:
    """The meta of `journal`: a regular file (not a FIFO, not a symlink) of bounded size, owned
    by one of `owners` when given, every field checked. Refusals are UntrustedInput (a
    ValueError) naming the meta file."""
    path = meta_path_for(journal)
    return JournalMeta.from_json(read_bounded(path, max_bytes=META_MAX_BYTES, owners=owners), path)
