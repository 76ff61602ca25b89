"""Finds and reads the per-rank dump files of one directory, in the three formats we accept.

All are named xpu_timer's way, `{rank}-{world}` and a suffix:
- `00003-00008.stack.json`: ours (`diag.stack/1`, see formats/stackdump.py);
- `00003-00008.stacktrace`: xpu_timer's protobuf (see xpu_stacktrace.py);
- `00003-00008.json`, `00003-00008.pyspy.json`, ...: raw `py-spy dump --json [--native]` output.
`*.journal.json` (journal tails) and any JSON that is not a py-spy thread list are left alone.
When one rank has files in several formats, ours wins, then xpu_timer's.

Only regular files count: a symlink named like a dump is not followed (it is named in a
warning), a FIFO or device is passed over, and a file is read under its cap (formats/inputcaps.py). A name
whose rank or world size is out of bounds (above MAX_WORLD, or a rank not below the world size)
is a bad name, reported and not read.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from diag.formats import fastjson
from diag.formats.incidentdir import JOURNAL_TAIL_SUFFIX, tail_name
from diag.formats.inputcaps import DUMP_MAX_BYTES, MAX_WORLD, clean, clean_lines, read_capped
from diag.formats.stackdump import (
    STACK_FORMAT,
    STACK_SUFFIX,
    FrameInterner,
    RankDump,
    pyspy_threads,
)
from diag.formats.untrusted import UntrustedInput
from diag.viewer.xpu_stacktrace import StacktraceError, StacktraceReader

log = logging.getLogger(__name__)
T = TypeVar("T")

_NAME = re.compile(r"^(\d+)-(\d+)(\..+)$")
XPU_SUFFIX = ".stacktrace"
NOT_DUMPS = (JOURNAL_TAIL_SUFFIX,)


class DumpFormat(enum.StrEnum):
    DIAG = "diag.stack/1"
    XPU_TIMER = "xpu_timer .stacktrace"
    PYSPY = "py-spy JSON"


_PREFERENCE = {DumpFormat.DIAG: 0, DumpFormat.XPU_TIMER: 1, DumpFormat.PYSPY: 2}


@dataclass(frozen=True)
class DumpFile:
    """A dump file of one rank, named `<rank>-<world><suffix>`, in a format the merge reads."""

    directory: Path
    name: str
    rank: int
    world_size: int
    format: DumpFormat
    journal: str = ""  # the rank's journal tail beside it (see journals.py), when there is one

    @property
    def path(self) -> Path:
        # Made on demand: building 16k Path objects up front costs more than reading the files.
        return self.directory / self.name


def classify(name: str) -> tuple[int, int, DumpFormat] | None:
    """Rank, world size and format of a dump file's name; None for a file that is no dump.
    Raises BadName when the name is a dump's but its numbers cannot be."""
    m = _NAME.match(name)
    if m is None or name.endswith(NOT_DUMPS):
        return None
    suffix = m.group(3)
    if suffix == STACK_SUFFIX:
        fmt = DumpFormat.DIAG
    elif suffix == XPU_SUFFIX:
        fmt = DumpFormat.XPU_TIMER
    elif suffix.endswith(".json"):
        fmt = DumpFormat.PYSPY
    else:
        return None
    # Bounded before int(): a name of a million digits would cost seconds to convert.
    digits = len(str(MAX_WORLD))
    if len(m.group(1)) > digits + 8 or len(m.group(2)) > digits + 8:
        raise BadName(name, "its rank or world size has too many digits")
    rank, world = int(m.group(1)), int(m.group(2))
    if not 0 < world <= MAX_WORLD:
        raise BadName(name, f"world size {world} is out of range [1, {MAX_WORLD}]")
    if rank >= world:
        raise BadName(name, f"rank {rank} is not below its world size {world}")
    if not name.isprintable():
        raise BadName(name, "it holds control characters")
    return rank, world, fmt


class BadName(ValueError):
    """A file named like a dump whose rank or world size cannot be right."""

    def __init__(self, name: str, problem: str) -> None:
        self.name, self.problem = clean(name), problem
        super().__init__(f"{self.name}: not read: {problem}")


@dataclass(frozen=True)
class Scan:
    """The dump files of a directory (one per rank, the preferred format, by rank) and what was
    passed over: files with bad names, symlinks named like dumps."""

    files: tuple[DumpFile, ...]
    bad_names: tuple[str, ...] = ()  # one message per file
    symlinks: tuple[str, ...] = ()  # their names, cleaned

    def problems(self, directory: Path) -> list[str]:
        out = [f"{clean(str(directory))}/{b}" for b in self.bad_names]
        if self.symlinks:
            out.append(
                f"{clean(str(directory))}: symlinks not followed: {', '.join(self.symlinks)}"
            )
        return out


def scan(directory: Path) -> Scan:
    """The dump files directly in `directory`: regular files only (a symlink is not followed,
    a FIFO or device is passed over)."""
    best: dict[int, DumpFile] = {}
    bad: list[str] = []
    links: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return Scan(())
    tails = {
        e.name
        for e in entries
        if e.name.endswith(JOURNAL_TAIL_SUFFIX) and e.is_file(follow_symlinks=False)
    }
    for entry in entries:
        try:
            found = classify(entry.name)
        except BadName as e:
            bad.append(str(e))
            continue
        if found is None:
            continue
        if not entry.is_file(follow_symlinks=False):
            if entry.is_symlink():
                links.append(clean(entry.name))
            continue
        rank, world, fmt = found
        tail = tail_name(entry.name)
        f = DumpFile(directory, entry.name, rank, world, fmt, tail if tail in tails else "")
        old = best.get(rank)
        if old is None or _PREFERENCE[fmt] < _PREFERENCE[old.format]:
            best[rank] = f
    if links:
        log.warning(
            "%s: symlinks named like dumps, not followed: %s",
            clean(str(directory)),
            ", ".join(sorted(links)),
        )
    return Scan(tuple(best[r] for r in sorted(best)), tuple(sorted(bad)), tuple(sorted(links)))


def dump_files(directory: Path) -> list[DumpFile]:
    """The dump files directly in `directory`, one per rank (the preferred format), by rank."""
    return list(scan(directory).files)


def _names_dump(name: str) -> bool:
    try:
        return classify(name) is not None
    except BadName:
        return True  # reported when the directory is read


def has_dumps(directory: Path) -> bool:
    try:
        return any(
            _names_dump(e.name) for e in os.scandir(directory) if e.is_file(follow_symlinks=False)
        )
    except OSError:
        return False


def _unreadable(f: DumpFile, why: str) -> RankDump:
    log.warning("cannot read %s: %s", clean(str(f.path)), why)
    return RankDump(
        rank=f.rank,
        world_size=f.world_size,
        pid=0,
        error=f"unreadable {f.format.value} file: {clean_lines(why)}",
    )


def load_dump(
    f: DumpFile, interner: FrameInterner, reader: StacktraceReader | None = None
) -> RankDump | None:
    """The dump of one file; an unreadable file yields a dump carrying the error (the rank
    shows up as failed rather than vanishing); None for a JSON file that is no stack dump.
    `reader` (sharing `interner`) remembers the thread stacks of `.stacktrace` files across
    calls."""
    try:
        data = read_capped(os.path.join(f.directory, f.name), DUMP_MAX_BYTES)
    except UntrustedInput as e:
        return _unreadable(f, e.problem)
    if f.format is DumpFormat.XPU_TIMER:
        try:
            return (reader or StacktraceReader(interner)).read(data, f.rank, f.world_size)
        except StacktraceError as e:
            return _unreadable(f, f"bad protobuf: {e}")
    try:
        raw = fastjson.loads(data)
    except (ValueError, RecursionError) as e:
        return _unreadable(f, f"bad JSON: {e}")
    try:
        if isinstance(raw, dict) and raw.get("format") == STACK_FORMAT:
            dump = RankDump.from_dict(raw, interner)
            if (dump.rank, dump.world_size) != (f.rank, f.world_size):
                return _unreadable(
                    f, f"it holds rank {dump.rank} of {dump.world_size}, not what its name says"
                )
            return dump
        if f.format is DumpFormat.DIAG:
            return _unreadable(f, f"not a {STACK_FORMAT} dump")
        if not (isinstance(raw, list) and all(isinstance(t, dict) and "frames" in t for t in raw)):
            log.debug("%s is not py-spy JSON; skipped", f.path)
            return None
        threads = pyspy_threads(raw, interner)
        pid = int(raw[0].get("pid") or 0) if raw else 0
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        return _unreadable(f, clean(f"unexpected content: {e!r}"[:400]))
    return RankDump(
        rank=f.rank,
        world_size=f.world_size,
        pid=pid,
        native=any(fr.native for t in threads for fr in t.frames),
        threads=threads,
        error="" if threads else "py-spy listed no thread",
    )


# Below this many files (and this many bytes), starting worker processes costs more than it
# saves: production dumps (~150 KB each, 75 threads) pay at a few hundred files already.
PARALLEL_FROM = 2048
PARALLEL_FROM_BYTES = 32 << 20


def _load_chunk(files: list[DumpFile]) -> list[RankDump | None]:
    interner = FrameInterner(blank_addresses=True)
    reader = StacktraceReader(interner)
    return [load_dump(f, interner, reader) for f in files]


def default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def _worth_it(files: Sequence[DumpFile], parallel_from: int) -> bool:
    if len(files) >= parallel_from:
        return True
    if len(files) < 64:
        return False
    try:  # the first file's size stands for all: one stat, not thousands
        return os.stat(files[0].path).st_size * len(files) >= PARALLEL_FROM_BYTES
    except OSError:
        return False


def map_chunks(
    files: Sequence[DumpFile],
    work: Callable[[list[DumpFile]], T],
    workers: int = 1,
    parallel_from: int = PARALLEL_FROM,
) -> list[T]:
    """`work` on consecutive chunks of `files`, one per worker process when there are
    `parallel_from` files or more (JSON and protobuf parsing hold the GIL), else on all of them
    here; the results in order."""
    if workers <= 1 or not _worth_it(files, parallel_from):
        return [work(list(files))]
    # imported here: only a merge of thousands of files pays for them
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    size = -(-len(files) // workers)
    chunks = [list(files[i : i + size]) for i in range(0, len(files), size)]
    # fork starts in milliseconds, spawn in a quarter second; but forking a process that runs
    # other threads (a daemon calling us) can deadlock the child, so only a lone thread forks.
    single = threading.active_count() == 1
    method = "fork" if single and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    with ProcessPoolExecutor(max_workers=len(chunks), mp_context=ctx) as pool:
        return list(pool.map(work, chunks))


def load_dumps(
    files: Sequence[DumpFile], workers: int = 1, parallel_from: int = PARALLEL_FROM
) -> list[RankDump | None]:
    """`load_dump` of each file, in order. With `workers` > 1 and enough files, parsing runs in
    that many processes; each returns its share pickled, where stacks shared by many ranks
    travel once."""
    return [d for part in map_chunks(files, _load_chunk, workers, parallel_from) for d in part]
