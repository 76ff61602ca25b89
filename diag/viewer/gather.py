"""Reading an incident's dumps and collecting their stacks, in worker processes when there are
thousands.

Each worker reads its share of the files (and the journal tails beside them, see journals.py),
tells every thread's role, and aggregates the stacks of both views by distinct stack
(tree.collect). What comes back is small: the dumps without their threads (rank, state, error,
node), and per view the distinct stacks with how many threads and which ranks have each.
Merging then costs per distinct stack, not per thread of every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from diag.formats.stackdump import FrameInterner, RankDump
from diag.viewer import ranksets
from diag.viewer.journals import JournalThreads, read_journal_threads
from diag.viewer.roles import RoleCache
from diag.viewer.sources import DumpFile, load_dump, map_chunks
from diag.viewer.tree import Collected, View, collect
from diag.viewer.xpu_stacktrace import StacktraceReader


@dataclass
class Gathered:
    """What reading hands on: the dumps (threads dropped) and the collected stacks per view."""

    dumps: list[RankDump]  # by rank, their threads left out
    formats: Counter  # dump format -> files read
    collected: dict[View, list[Collected]]
    with_stacks: int  # bitset: ranks whose dump holds threads


def _strip(d: RankDump) -> RankDump:
    return dataclasses.replace(d, threads=(), native_threads=())


def gather_dumps(
    dumps: Sequence[RankDump],
    formats: Counter | None = None,
    journals: dict[int, JournalThreads] | None = None,
) -> Gathered:
    """The stacks of dumps already read (with what their journal tails say), collected as the
    workers collect them."""
    cache = RoleCache(journals)
    collected = {v: [collect(dumps, v, cache)] for v in View}
    with_stacks = ranksets.bits_of(d.rank for d in dumps if d.threads or d.native_threads)
    return Gathered([_strip(d) for d in dumps], formats or Counter(), collected, with_stacks)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Reading thousands of dumps allocates millions of objects that all stay alive until the
    stacks are collected: the cyclic collector would scan them again and again (an eighth of
    the time) to free nothing. Reference counting still frees what dies."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _gather_chunk(files: list[DumpFile]) -> Gathered:
    with _no_gc():
        return _gather_files(files)


def _gather_files(files: list[DumpFile]) -> Gathered:
    interner = FrameInterner(blank_addresses=True)
    reader = StacktraceReader(interner)
    dumps: list[RankDump] = []
    journals: dict[int, JournalThreads] = {}
    formats: Counter = Counter()
    for f in files:
        d = load_dump(f, interner, reader)
        if d is not None:
            dumps.append(d)
            formats[f.format.value] += 1
            if f.journal:
                found = read_journal_threads(os.path.join(f.directory, f.journal))
                if found is not None:
                    journals[f.rank] = found
    return gather_dumps(dumps, formats, journals)


def gather(files: Sequence[DumpFile], workers: int = 1) -> Gathered:
    parts = map_chunks(files, _gather_chunk, workers)
    out = Gathered([], Counter(), {v: [] for v in View}, 0)
    for p in parts:
        out.dumps.extend(p.dumps)
        out.formats.update(p.formats)
        for v in View:
            out.collected[v].extend(p.collected[v])
        out.with_stacks |= p.with_stacks
    out.dumps.sort(key=lambda d: d.rank)
    return out
