"""Ranks that did not answer: no dump file, an unreadable one, or one without stacks.

In a hang, a rank that could not be dumped is evidence: its node may be down, its process gone
or stuck in the kernel, its dump tool hung. When every rank that answered waits in the same
place, the ranks that did not are where to look first. Ranks that fill a whole node (the local
world size from the dumps, the journals or a flag) are named as that node: a node that is gone
is one fact, not eight.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from diag.formats.stackdump import RankDump
from diag.viewer import ranksets
from diag.viewer.tree import NO_DUMP, Collected, View


@dataclass(frozen=True)
class AbsentNode:
    """A node none of whose ranks answered."""

    index: int  # rank // local world size
    local: int  # ranks per node

    @property
    def bits(self) -> int:
        # made when asked, not kept: a bitset as wide as the world per silent node would cost
        # memory quadratic in the world
        return ((1 << self.local) - 1) << (self.index * self.local)

    @property
    def ranks(self) -> str:
        lo, hi = self.index * self.local, (self.index + 1) * self.local - 1
        return str(lo) if lo == hi else f"{lo}-{hi}"

    @property
    def label(self) -> str:
        return f"node {self.index} (ranks {self.ranks})"


@dataclass(frozen=True)
class Absent:
    """The ranks that did not answer and why."""

    missing: int  # bitset: no dump file at all
    failed: tuple[tuple[int, str], ...]  # (rank, error): a file without stacks
    nodes: tuple[AbsentNode, ...]  # nodes none of whose ranks answered
    local_world_size: int | None

    @property
    def bits(self) -> int:
        return self.missing | ranksets.bits_of(r for r, _ in self.failed)

    @functools.cached_property
    def _by_index(self) -> dict[int, AbsentNode]:
        return {n.index: n for n in self.nodes}

    def node_of(self, rank: int) -> AbsentNode | None:
        if not self.nodes or not self.local_world_size:
            return None
        index = rank // self.local_world_size
        return self._by_index.get(index)

    def reason(self, rank: int) -> str:
        node = self.node_of(rank)
        where = f"; all of {node.label} is silent" if node is not None else ""
        if self.missing >> rank & 1:
            return f"did not answer: no dump{where}"
        error = dict(self.failed).get(rank, "")
        first = (error.strip().splitlines() or ["?"])[0][:160]
        return f"did not answer: {first}{where}"


def local_world_size(
    dumps: Iterable[RankDump], journal_sizes: Iterable[int] = (), given: int | None = None
) -> int | None:
    """Ranks per node: the flag, else what the journals say, else the dumps' local ranks (the
    largest local rank + 1, when the dumps say which node they come from)."""
    if given:
        return given
    sizes = {s for s in journal_sizes if s > 0}
    if len(sizes) == 1:
        return sizes.pop()
    top = max((d.local_rank for d in dumps if d.node and d.local_rank >= 0), default=-1)
    return top + 1 if top >= 0 else None


def find_absent(
    world: int, dumps: Sequence[RankDump], local: int | None = None, with_stacks: int | None = None
) -> Absent:
    """Which ranks of `world` did not answer: those without a dump in `dumps`, and those whose
    dump carries an error instead of stacks (`with_stacks`: the ranks whose dumps hold stacks,
    when `dumps` were read without them). Runs of them that fill whole nodes of `local` ranks
    are named as nodes."""
    present = ranksets.bits_of(d.rank for d in dumps)
    missing = ((1 << world) - 1) & ~present
    if with_stacks is None:
        with_stacks = ranksets.bits_of(d.rank for d in dumps if d.threads or d.native_threads)
    failed = tuple((d.rank, d.error) for d in dumps if d.error and not with_stacks >> d.rank & 1)
    silent = missing | ranksets.bits_of(r for r, _ in failed)
    nodes: list[AbsentNode] = []
    if local and local > 0 and world % local == 0:
        for lo, hi in ranksets.ranges_of(silent):  # the nodes each run of silent ranks fills
            first, end = -(-lo // local), (hi + 1) // local
            nodes.extend(AbsentNode(index, local) for index in range(first, end))
    return Absent(missing, failed, tuple(nodes), local)


def stand_ins(absent: Absent, world: int) -> list[RankDump]:
    """A dump per rank without a file, carrying why, so that the pictures draw the silent ranks
    as a tower of their own (one per silent node, one for scattered ranks)."""
    out = []
    for rank in ranksets.ranks_of(absent.missing):
        node = absent.node_of(rank)
        what = (
            f"{NO_DUMP}: {node.label} did not answer" if node else f"{NO_DUMP}: rank did not answer"
        )
        out.append(RankDump(rank=rank, world_size=world, pid=0, error=what))
    return out


def nodes_bits(nodes: Sequence[AbsentNode]) -> int:
    """The ranks of `nodes` (ascending, of one size), one shift per run of adjacent nodes."""
    bits, i = 0, 0
    while i < len(nodes):
        j = i
        while j + 1 < len(nodes) and nodes[j + 1].index == nodes[j].index + 1:
            j += 1
        local = nodes[i].local
        bits |= ((1 << ((j - i + 1) * local)) - 1) << (nodes[i].index * local)
        i = j + 1
    return bits


# Silent nodes drawn as a tower each; the rest share one (a tower's bitset is as wide as the
# world: thousands of them would cost memory quadratic in it). summary.txt names them all.
MAX_NODE_TOWERS = 256


def stand_in_stacks(absent: Absent, view: View) -> Collected:
    """What `collect` makes of `stand_ins`, built from the bitsets alone: one entry per silent
    node (up to MAX_NODE_TOWERS, then one for the others) and one for the scattered ranks, at a
    cost per node, not per rank."""
    groups: list[tuple[int, str]] = []
    for node in absent.nodes[:MAX_NODE_TOWERS]:
        bits = node.bits & absent.missing
        if bits:
            groups.append((bits, f"{NO_DUMP}: {node.label} did not answer"))
    more = nodes_bits(absent.nodes[MAX_NODE_TOWERS:]) & absent.missing
    if more:
        others = len(absent.nodes) - MAX_NODE_TOWERS
        groups.append((more, f"{NO_DUMP}: {others} more whole nodes did not answer"))
    scattered = absent.missing & ~nodes_bits(absent.nodes)
    if scattered:
        groups.append((scattered, f"{NO_DUMP}: rank did not answer"))
    groups.sort(key=lambda g: ranksets.lowest(g[0]))  # in rank order, as collect meets them
    return Collected(
        view, {("", None, what, None, False): (b.bit_count(), b) for b, what in groups}
    )
