"""Sets of ranks as bitsets, and their folded text form (`0-5/7-11`).

A set of ranks is a Python int used as a bitset (bit r set = rank r is in the set). At 16k ranks
that is 2 KiB per set, and union, difference and counting run in C; a Python set of ints would be
~100x larger and slower to combine.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

_RUNS = re.compile(r"1+")


def bits_of(ranks: Iterable[int]) -> int:
    ranks = list(ranks)
    if not ranks:
        return 0
    buf = bytearray(max(ranks) // 8 + 1)
    for r in ranks:
        if r < 0:
            raise ValueError(f"negative rank {r}")
        buf[r >> 3] |= 1 << (r & 7)
    return int.from_bytes(buf, "little")


def ranks_of(bits: int) -> list[int]:
    out: list[int] = []
    for lo, hi in ranges_of(bits):
        out.extend(range(lo, hi + 1))
    return out


def ranges_of(bits: int, limit: int | None = None) -> list[tuple[int, int]]:
    """The runs of consecutive ranks in a bitset, as inclusive (first, last) pairs, ascending;
    only the first `limit` runs when given."""
    if bits < 0:
        raise ValueError("a rank bitset cannot be negative")
    if not bits:
        return []
    if bits & (bits - 1) == 0:  # one rank: the common case for an odd rank's frames
        r = bits.bit_length() - 1
        return [(r, r)]
    # from the lowest rank on: a few ranks high up in a wide world (a silent node's) cost their
    # own width, not the world's
    low = lowest(bits)
    text = bin(bits >> low)[:1:-1]  # bit i at index i
    runs = _RUNS.finditer(text)
    if limit is not None:
        runs = itertools.islice(runs, limit)
    return [(m.start() + low, m.end() - 1 + low) for m in runs]


def fold(bits: int, max_ranges: int | None = None) -> str:
    """`0-5/7-11`: runs joined by `/`. With `max_ranges`, a longer list keeps its first runs and
    ends in `/...(+N)`, N being the ranks left out, so a label stays readable at any scale."""
    if max_ranges is None:
        return "/".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges_of(bits))
    ranges = ranges_of(bits, max_ranges + 1)
    if len(ranges) <= max_ranges:
        return "/".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)
    keep = ranges[: max(max_ranges - 1, 1)]
    left = (bits >> (keep[-1][1] + 1)).bit_count()
    parts = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in keep]
    return "/".join([*parts, f"...(+{left})"])


def fold_ranks(ranks: Iterable[int], max_ranges: int | None = None) -> str:
    return fold(bits_of(ranks), max_ranges)


def parse(text: str) -> int:
    """The inverse of `fold` (without an abbreviation): `0-5/7` -> bitset."""
    bits = 0
    for part in filter(None, text.strip().split("/")):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad rank range {part!r}")
        bits |= ((1 << (last - first + 1)) - 1) << first
    return bits


def lowest(bits: int) -> int:
    """The smallest rank in a non-empty set."""
    return (bits & -bits).bit_length() - 1


class RankText:
    """Formats `<ranks with>|<ranks without>` against the set of ranks present in a merge, with
    a cache: many frames share one rank set (every frame of one rank's own tail, say)."""

    def __init__(self, present: int, max_ranges: int | None = None) -> None:
        self.present = present
        self.max_ranges = max_ranges
        self._cache: dict[int, str] = {}

    def fold(self, bits: int) -> str:
        found = self._cache.get(bits)
        if found is None:
            found = self._cache[bits] = fold(bits, self.max_ranges)
        return found

    def with_without(self, bits: int) -> str:
        return f"{self.fold(bits)}|{self.fold(self.present & ~bits)}"
