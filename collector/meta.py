"""The journal's companion file: who wrote it and which process groups its records refer to.

The binary ring holds only hot data; everything static (identity, group membership) lives in a
small JSON file next to it, replaced atomically (write to a temp name, rename) so a reader never
sees half of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

META_VERSION = 1
JOURNAL_SUFFIX = ".journal"
META_SUFFIX = ".meta.json"


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
    def from_json(cls, text: str) -> JournalMeta:
        raw = json.loads(text)
        if raw.get("version") != META_VERSION:
            raise ValueError(f"unsupported journal meta version {raw.get('version')!r}")
        groups = tuple(
            GroupInfo(
                index=int(g["index"]),
                name=str(g["name"]),
                ranks=tuple(int(r) for r in g["ranks"]),
                backend=str(g.get("backend", "")),
                desc=str(g.get("desc", "")),
                timeout_s=float(g.get("timeout_s", 0.0)),
            )
            for g in raw.get("groups", ())
        )
        known = {f for f in cls.__dataclass_fields__ if f not in ("groups", "own_threads")}
        own = tuple(int(t) for t in raw.get("own_threads") or ())
        return cls(groups=groups, own_threads=own, **{k: v for k, v in raw.items() if k in known})


def safe_job_name(job: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", job).strip("._")
    return cleaned[:64] or "job"


def journal_path(run_dir: Path, job: str, rank: int) -> Path:
    return run_dir / f"{safe_job_name(job)}-rank{rank:05d}{JOURNAL_SUFFIX}"


def meta_path_for(journal: Path) -> Path:
    return journal.with_name(journal.name[: -len(JOURNAL_SUFFIX)] + META_SUFFIX)


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` so that readers see either the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_meta(journal: Path, meta: JournalMeta) -> None:
    write_atomic(meta_path_for(journal), meta.to_json().encode())


def read_meta(journal: Path) -> JournalMeta:
    return JournalMeta.from_json(meta_path_for(journal).read_text())
