"""Stacks of one rank: our own types, our dump file format, and the py-spy JSON parser.

An incident directory holds one dump file per rank, named `{rank:05d}-{world:05d}.stack.json`
(the xpu_timer naming, with our suffix). Frames are stored root first (outermost call first), the
order flame graphs draw them in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

STACK_FORMAT = "diag.stack/1"
STACK_SUFFIX = ".stack.json"


@dataclass(frozen=True)
class Frame:
    func: str
    file: str  # full path for Python frames, the library for native ones
    line: int  # 0 for native frames
    native: bool = False
    module: str = ""  # the shared object of a native frame

    @property
    def short_file(self) -> str:
        return self.file.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ThreadStack:
    tid: int  # Python's thread identifier (pthread id)
    os_tid: int
    name: str
    frames: tuple[Frame, ...]  # root first
    active: bool = False  # on CPU at the time of the dump
    owns_gil: bool = False


@dataclass(frozen=True)
class RankDump:
    rank: int
    world_size: int
    pid: int
    node: str = ""
    local_rank: int = -1
    process_state: str = ""  # /proc state letter and word, e.g. "S (sleeping)", "D (disk sleep)"
    native: bool = False  # captured with native frames
    captured_at: str = ""  # ISO-8601 UTC
    capture_seconds: float = 0.0
    threads: tuple[ThreadStack, ...] = field(default_factory=tuple)
    error: str = ""  # why no stack could be taken, when none was
    format: str = STACK_FORMAT

    @property
    def file_name(self) -> str:
        return dump_file_name(self.rank, self.world_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, raw: dict) -> RankDump:
        if raw.get("format") != STACK_FORMAT:
            raise ValueError(f"not a {STACK_FORMAT} dump (format={raw.get('format')!r})")
        threads = tuple(
            ThreadStack(
                tid=int(t["tid"]),
                os_tid=int(t.get("os_tid", 0)),
                name=str(t.get("name", "")),
                frames=tuple(Frame(**f) for f in t["frames"]),
                active=bool(t.get("active", False)),
                owns_gil=bool(t.get("owns_gil", False)),
            )
            for t in raw.get("threads", ())
        )
        known = {k for k in cls.__dataclass_fields__ if k != "threads"}
        return cls(threads=threads, **{k: v for k, v in raw.items() if k in known})

    @classmethod
    def load(cls, path: Path) -> RankDump:
        return cls.from_dict(json.loads(path.read_text()))


def dump_file_name(rank: int, world_size: int) -> str:
    return f"{rank:05d}-{world_size:05d}{STACK_SUFFIX}"


def parse_pyspy_json(text: str) -> tuple[ThreadStack, ...]:
    """Parses `py-spy dump --json [--native]` output. py-spy lists frames innermost first and marks
    native frames with the library in `module` (and line 0)."""
    raw = json.loads(text)
    if not isinstance(raw, list):
        raise ValueError("py-spy JSON output must be a list of threads")
    threads = []
    for t in raw:
        frames = []
        for f in reversed(t.get("frames") or []):
            module = f.get("module") or ""
            frames.append(
                Frame(
                    func=str(f.get("name", "?")),
                    file=str(f.get("filename", "")),
                    line=int(f.get("line") or 0),
                    native=bool(module),
                    module=module,
                )
            )
        threads.append(
            ThreadStack(
                tid=int(t.get("thread_id", 0)),
                os_tid=int(t.get("os_thread_id") or 0),
                name=str(t.get("thread_name") or ""),
                frames=tuple(frames),
                active=bool(t.get("active", False)),
                owns_gil=bool(t.get("owns_gil", False)),
            )
        )
    return tuple(threads)
