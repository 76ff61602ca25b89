"""The search behind elastic batch sizes (DeepSpeed's rules for config versions 0.1 and 0.2).

A global batch keeps many world sizes valid when it has many divisors. The candidates are each
micro batch size, and their least common multiple, scaled by the largest highly composite number
that stays within the maximum batch; the winner is the candidate with the most valid world sizes
in [min_gpus, max_gpus] (ties: the larger batch, or the smaller with prefer_larger_batch false).
A world size n is valid for batch B when some micro batch m divides B and n divides B / m.

Version 0.2 counts nodes instead of GPUs (the search runs on B / ranks-per-node, the result is
scaled back), and at a world size outside its list it does not refuse: it takes the largest (or
smallest) multiple of micro batch x data-parallel size within the maximum, changing the batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

# The highly composite numbers up to 720720 (OEIS A002182): DeepSpeed scales by these and by
# nothing larger, so neither do we.
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
    10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
    332640, 498960, 554400, 665280, 720720,
)  # fmt: skip


class SearchError(ValueError):
    pass


def scaled_candidates(bases: Iterable[int], cap: int) -> set[int]:
    """Each base times the largest highly composite number keeping it within `cap` (a base equal
    to the cap stays as it is; a base above it is dropped)."""
    out = set()
    for base in bases:
        if base > cap:
            continue
        if base == cap:
            out.add(base)
            continue
        room = cap // base
        out.add(base * max(h for h in HIGHLY_COMPOSITE if h <= room))
    return out


def valid_world_sizes(batch: int, micro: Sequence[int], lo: int, hi: int) -> tuple[int, ...]:
    """World sizes in [lo, hi] that split `batch` into whole micro batches of one of `micro`."""
    sizes = set()
    for m in micro:
        if batch % m:
            continue
        ranks = batch // m  # at most this many ranks, one micro batch each
        if lo <= ranks <= hi:
            sizes.add(ranks)
        # The proper divisors (DeepSpeed looks at those up to half of it).
        for n in range(max(1, lo), min(hi, ranks // 2) + 1):
            if ranks % n == 0:
                sizes.add(n)
    return tuple(sorted(sizes))


def pick_batch(
    candidates: Iterable[int], micro: Sequence[int], lo: int, hi: int, prefer_larger: bool
) -> tuple[int, tuple[int, ...] | None]:
    """The candidate with the most valid world sizes. When none has any, DeepSpeed still moves to
    a candidate above the smallest micro batch if it prefers larger batches (an empty list), and
    otherwise stays at the smallest micro batch with no list at all (None). Both leave no valid
    size, but version 0.2 treats them apart."""
    scored = [(c, valid_world_sizes(c, micro, lo, hi)) for c in candidates]
    most = max((len(s) for _, s in scored), default=0)
    floor = min(micro)
    if most == 0:
        above = [c for c, _ in scored if c > floor]
        return (max(above), ()) if prefer_larger and above else (floor, None)
    best = [(c, s) for c, s in scored if len(s) == most]
    return (max if prefer_larger else min)(best, key=lambda cs: cs[0])


def best_batch_v01(
    micro: Sequence[int], cap: int, min_gpus: int, max_gpus: int, prefer_larger: bool
) -> tuple[int, tuple[int, ...] | None]:
    """Version 0.1: (global batch, valid world sizes; None: see pick_batch)."""
    lo = min_gpus or 1
    hi = max_gpus or cap // min(micro)
    if any(m > cap for m in micro):
        raise SearchError(f"every micro batch size must be at most {cap}, got {list(micro)}")
    bases = [*micro, math.lcm(*micro)]
    return pick_batch(scaled_candidates(bases, cap), micro, lo, hi, prefer_larger)


def best_batch_v02(
    micro: Sequence[int],
    cap: int,
    world_size: int,
    min_gpus: int,
    max_gpus: int,
    prefer_larger: bool,
    gpus_per_node: int,
    model_parallel: int,
) -> tuple[int, tuple[int, ...], bool]:
    """Version 0.2: (global batch, valid data-parallel sizes, whether `world_size` was in the
    list; when it was not, the batch and the one-size list are the ones chosen for it)."""
    if gpus_per_node % model_parallel:
        raise SearchError(
            f"num_gpus_per_node ({gpus_per_node}) must be divisible by model_parallel_size "
            f"({model_parallel})"
        )
    per_node = gpus_per_node // model_parallel  # data-parallel ranks per node
    # The search counts nodes; DeepSpeed truncates these quotients (int of a float division).
    node_batch, node_counts = best_batch_v01(
        micro, int(cap / per_node), int(min_gpus / gpus_per_node),
        int(max_gpus / gpus_per_node), prefer_larger,
    )  # fmt: skip
    batch = node_batch * per_node
    if node_counts is None:
        return batch, (), True  # DeepSpeed fails here whatever the world size: none is valid
    sizes = tuple(n * per_node for n in node_counts)
    if world_size // model_parallel in sizes:
        return batch, sizes, True
    # Outside the list: a batch for this size. Float arithmetic as DeepSpeed does it, so that
    # the truncations agree.
    dp = (world_size / gpus_per_node) * per_node
    options = [math.floor(cap / float(m * dp)) * (m * dp) for m in micro]
    chosen = max(options) if prefer_larger else min(options)
    return int(chosen), (int(dp),), False


def micro_batch_for(batch: int, world_size: int, micro: Sequence[int]) -> int | None:
    """The largest micro batch size that divides a rank's share of the batch."""
    share = batch // world_size
    for m in sorted(set(micro), reverse=True):
        if share % m == 0:
            return m
    return None
