"""Stacks of one rank: our own types, our dump file format, and the py-spy JSON parser.

An incident directory holds one dump file per rank, named `{rank:05d}-{world:05d}.stack.json`
(the xpu_timer naming, with our suffix). Frames are stored root first (outermost call first), the
order flame graphs draw them in.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diag.formats import fastjson
from diag.formats.inputcaps import MAX_WORLD, clean, clean_lines

STACK_FORMAT = "diag.stack/1"
STACK_SUFFIX = ".stack.json"
UNRESOLVED = "??"  # a native frame the unwinder could not name
# py-spy names an unresolved native frame by its address, which differs in every process
ADDRESS = re.compile(r"^(0x)?[0-9a-fA-F]{6,}$")


@dataclass(frozen=True)
class Frame:
    """One frame of a stack, interned: equal frames are one object."""

    func: str
    file: str  # full path for Python frames, the library for native ones
    line: int  # 0 for native frames
    native: bool = False
    module: str = ""  # the shared object of a native frame

    @property
    def short_file(self) -> str:
        return self.file.rsplit("/", 1)[-1]


# Not frozen, though nothing changes one: a merge of 16k ranks builds a million of them, and a
# frozen dataclass's __init__ costs five times more. Hashable by value all the same.
@dataclass(slots=True, unsafe_hash=True)
class ThreadStack:
    """One thread of a rank's dump: its identity and its frames, root first."""

    tid: int  # Python's thread identifier (pthread id)
    os_tid: int
    name: str
    frames: tuple[Frame, ...]  # root first
    active: bool = False  # on CPU at the time of the dump
    owns_gil: bool = False


@dataclass(frozen=True)
class RankDump:
    """One rank's dump: the process it came from and its threads."""

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
    # Stacks from a separate native unwinder (gdb/pstack, as xpu_timer takes them), kept apart
    # from `threads` when those came without native frames. Empty for py-spy --native dumps,
    # whose `threads` already interleave native and Python frames.
    native_threads: tuple[ThreadStack, ...] = field(default_factory=tuple)

    @property
    def file_name(self) -> str:
        return dump_file_name(self.rank, self.world_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, raw: dict, interner: FrameInterner | None = None) -> RankDump:
        """`interner` shares Frame objects and frame tuples among the dumps it reads: merging
        thousands of ranks whose stacks are mostly alike then costs memory per distinct frame,
        not per frame read."""
        if raw.get("format") != STACK_FORMAT:
            raise ValueError(f"not a {STACK_FORMAT} dump (format={raw.get('format')!r})")
        interner = interner or FrameInterner()

        def threads_of(key: str) -> tuple[ThreadStack, ...]:
            return tuple(
                ThreadStack(
                    tid=int(t["tid"]),
                    os_tid=int(t.get("os_tid", 0)),
                    name=clean(str(t.get("name", ""))),
                    frames=interner.frames_from_dicts(t["frames"]),
                    active=bool(t.get("active", False)),
                    owns_gil=bool(t.get("owns_gil", False)),
                )
                for t in raw.get(key) or ()
            )

        return cls(
            threads=threads_of("threads"),
            native_threads=threads_of("native_threads"),
            **_scalars(raw),
        )

    @classmethod
    def load(cls, path: Path, interner: FrameInterner | None = None) -> RankDump:
        return cls.from_dict(json.loads(path.read_bytes()), interner)


# The scalar fields of a dump file and how each is checked: ranks bounded, text cleaned.
_RANKS = ("rank", "world_size")
_INTS = ("pid", "local_rank")
_TEXTS = ("node", "process_state", "captured_at", "format")


def _int(raw: dict, key: str, lo: int, hi: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{key} {value!r} is not an integer in [{lo}, {hi}]")
    return value


def _scalars(raw: dict) -> dict[str, Any]:
    """The scalar fields of a dump document, validated into RankDump's types."""
    out: dict[str, Any] = {}
    for key in _RANKS:
        out[key] = _int(raw, key, 0, MAX_WORLD)
    for key in _INTS:
        if key in raw:
            out[key] = _int(raw, key, -1, 1 << 62)
    for key in _TEXTS:
        if key in raw:
            out[key] = clean(str(raw[key]))
    if "error" in raw:
        out["error"] = clean_lines(str(raw["error"]))
    if "native" in raw:
        out["native"] = bool(raw["native"])
    if "capture_seconds" in raw:
        value = raw["capture_seconds"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"capture_seconds {value!r} is not a number")
        out["capture_seconds"] = float(value)
    return out


_FRAME_FIELDS = operator.itemgetter("func", "file", "line", "native", "module")
_PYSPY_FIELDS = operator.itemgetter("name", "filename", "line", "module")


class FrameInterner:
    """Hands out one shared Frame per distinct frame and one shared tuple per distinct stack.

    Stacks of many ranks are mostly identical; sharing makes later grouping by stack cheap
    (identical stacks are the same object) and keeps memory flat in the number of ranks.
    `blank_addresses`: native frames named by an address (py-spy's unresolved frames) are
    named `??` instead, as the merged views label them anyway, so that ranks stopped in the same
    unresolved frames share their stacks (the agent keeps the addresses in its dumps).
    """

    def __init__(self, blank_addresses: bool = False) -> None:
        self.blank_addresses = blank_addresses
        self._keyer: Callable[[Any], bytes] | None = None
        self._keyer_known = False
        self._frames: dict[tuple, Frame] = {}
        # Keyed by the ids of interned frames: they live as long as this interner, so an id is
        # never reused while the key exists.
        self._stacks: dict[tuple[int, ...], tuple[Frame, ...]] = {}
        # Keyed by the raw content of a whole stack: a stack seen before costs one lookup.
        self._raw_stacks: dict[object, tuple[Frame, ...]] = {}

    def frame(self, func: str, file: str, line: int, native: bool, module: str) -> Frame:
        key = (func, file, line, native, module)
        found = self._frames.get(key)
        if found is None:
            if native and self.blank_addresses and ADDRESS.match(func):
                # not kept under the address: every process has its own
                return self.frame(UNRESOLVED, file, line, native, module)
            # Cleaned once per distinct frame, here, so that every output gets clean names.
            tidy = (clean(str(func)), clean(str(file)), int(line), bool(native), clean(str(module)))
            if tidy != key:
                found = self._frames[key] = self.frame(*tidy)
            else:
                found = self._frames[key] = Frame(func, file, line, native, module)
        return found

    def raw_key(self, raw: list[dict], fields: operator.itemgetter) -> object:
        """The key of a stack as its file gave it: its frames serialized (orjson), else the
        tuple of their `fields`."""
        if not self._keyer_known:  # orjson is imported at the first JSON stack, not before
            self._keyer, self._keyer_known = fastjson.stack_keyer(), True
        keyer = self._keyer
        return keyer(raw) if keyer is not None else tuple(map(fields, raw))

    def frames_from_dicts(self, raw: list[dict]) -> tuple[Frame, ...]:
        try:
            key = self.raw_key(raw, _FRAME_FIELDS)
        except (KeyError, TypeError):  # a dump written before a field existed
            return self._frames_from_dicts(raw)
        found = self._raw_stacks.get(key)
        if found is None:
            found = self._raw_stacks[key] = self._frames_from_dicts(raw)
        return found

    def _frames_from_dicts(self, raw: list[dict]) -> tuple[Frame, ...]:
        frame = self.frame
        return self._stack(
            [
                frame(f["func"], f["file"], f["line"], f.get("native", False), f.get("module", ""))
                for f in raw
            ]
        )

    def pyspy_frames(self, raw: list[dict]) -> tuple[Frame, ...]:
        """A thread's frames from `py-spy dump --json` (innermost first), root first."""
        try:
            key = self.raw_key(raw, _PYSPY_FIELDS)
        except (KeyError, TypeError):
            key = None
        found = self._raw_stacks.get(key) if key is not None else None
        if found is None:
            frames = []
            for f in reversed(raw):
                module = f.get("module") or ""
                frames.append(
                    self.frame(
                        str(f.get("name", "?")),
                        str(f.get("filename", "")),
                        int(f.get("line") or 0),
                        bool(module),
                        module,
                    )
                )
            found = self._stack(frames)
            if key is not None:
                self._raw_stacks[key] = found
        return found

    def stack(self, frames: list[Frame]) -> tuple[Frame, ...]:
        """Interns a stack of frames that may not come from this interner."""
        return self._stack([self.frame(f.func, f.file, f.line, f.native, f.module) for f in frames])

    def _stack(self, frames: list[Frame]) -> tuple[Frame, ...]:
        key = tuple(map(id, frames))
        found = self._stacks.get(key)
        if found is None:
            found = self._stacks[key] = tuple(frames)
        return found


def dump_file_name(rank: int, world_size: int) -> str:
    return f"{rank:05d}-{world_size:05d}{STACK_SUFFIX}"


def parse_pyspy_json(
    text: str | bytes, interner: FrameInterner | None = None
) -> tuple[ThreadStack, ...]:
    """Parses `py-spy dump --json [--native]` output. py-spy lists frames innermost first and marks
    native frames with the library in `module` (and line 0)."""
    return pyspy_threads(json.loads(text), interner)


def pyspy_threads(raw: object, interner: FrameInterner | None = None) -> tuple[ThreadStack, ...]:
    """The threads of already-decoded `py-spy dump --json` output."""
    if not isinstance(raw, list):
        raise ValueError("py-spy JSON output must be a list of threads")
    interner = interner or FrameInterner()
    threads = []
    for t in raw:
        if not isinstance(t, dict):
            raise ValueError("py-spy JSON output must be a list of thread objects")
        threads.append(
            ThreadStack(
                tid=int(t.get("thread_id") or 0),
                os_tid=int(t.get("os_thread_id") or 0),
                name=clean(str(t.get("thread_name") or "")),
                frames=interner.pyspy_frames(t.get("frames") or []),
                active=bool(t.get("active", False)),
                owns_gil=bool(t.get("owns_gil", False)),
            )
        )
    return tuple(threads)
