"""The merged tree as folded stacks (`a;b;c N`), the input format of flamegraph.pl.

One line per place where stacks end, root first; N is the number of stacks (ranks, one per
thread) that end there. Each frame is labelled as in xpu_timer's viewer:
`func@file:line@<ranks with it>|<ranks without>`, so the rank sets survive in any tool that
reads the format.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TextIO

from diag.viewer.ranksets import RankText
from diag.viewer.tree import StackTree

# Rank lists longer than this many runs are abbreviated in labels (`0/4/8/...(+4093)`); the
# summary keeps every rank of every class.
LABEL_MAX_RANGES = 32


def label(tree: StackTree, node: int, ranks: RankText) -> str:
    return f"{tree.info[node].text}@{ranks.with_without(tree.bits[node])}"


def folded_lines(tree: StackTree, ranks: RankText | None = None) -> Iterator[str]:
    ranks = ranks or RankText(tree.present, LABEL_MAX_RANGES)
    info, children, own = tree.info, tree.children, tree.own

    def ordered(node: int) -> list[int]:
        return sorted(children[node], key=lambda c: info[c].text, reverse=True)

    pending: list[tuple[int, str]] = [(c, "") for c in ordered(0)]
    while pending:
        node, prefix = pending.pop()
        here = label(tree, node, ranks)
        path = f"{prefix};{here}" if prefix else here
        if own[node]:
            yield f"{path} {own[node]}\n"
        pending.extend((c, path) for c in ordered(node))


def write_folded(tree: StackTree, out: TextIO) -> int:
    """Writes the folded stacks; returns the number of lines."""
    n = 0
    batch: list[str] = []
    for line in folded_lines(tree):
        batch.append(line)
        if len(batch) >= 4096:
            out.writelines(batch)
            n += len(batch)
            batch.clear()
    out.writelines(batch)
    return n + len(batch)
