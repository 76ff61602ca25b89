"""Where each frame of a merged tree goes in the flame graph.

Widths are proportional to the number of stacks through a frame (ranks, one per thread), with
two departures, both for scale:
- frames thinner than `min_width` pixels are merged, per parent, into one "other" cell (dropped
  when even that is too thin), as flamegraph.pl's --minwidth drops them, so that the file stays
  small at any rank count;
- frames that carry one of the top suspect ranks (`highlight`) are drawn at least
  `suspect_min_width` pixels wide, their siblings giving up the room: one odd rank among 16k
  would otherwise be 0.07 px wide and vanish. Tooltips give the true counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from diag.viewer import ranksets
from diag.viewer.tree import StackTree

OTHER = -1  # the node of an "other" cell


@dataclass(frozen=True)
class LayoutOptions:
    width: float = 1180.0  # pixels for the whole tree
    min_width: float = 0.1
    suspect_min_width: float = 8.0


@dataclass(frozen=True)
class Cell:
    node: int  # tree node, or OTHER
    depth: int
    x: float
    w: float
    bits: int  # ranks that reach it
    count: int  # stacks through it
    merged: int = 1  # frames an "other" cell stands for
    suspect: bool = False  # every rank that reaches it is a suspect


def _widths(
    tree: StackTree, kids: list[int], w: float, total: int, highlight: int, opts: LayoutOptions
) -> list[float]:
    count, bits = tree.count, tree.bits
    scale = w / total
    natural = [count[k] * scale for k in kids]
    if not highlight:
        return natural
    carries = [bool(bits[k] & highlight) for k in kids]
    if not any(carries):
        return natural
    want = [
        max(n, opts.suspect_min_width) if c else n for n, c in zip(natural, carries, strict=True)
    ]
    wanted = sum(wn for wn, c in zip(want, carries, strict=True) if c)
    rest = w - sum(
        n for n, c in zip(natural, carries, strict=True) if c
    )  # siblings and the parent's own
    if wanted >= w:
        return [wn * w / wanted if c else 0.0 for wn, c in zip(want, carries, strict=True)]
    shrink = (w - wanted) / rest if rest > 0 else 0.0
    return [wn if c else n * shrink for wn, n, c in zip(want, natural, carries, strict=True)]


def layout(
    tree: StackTree, suspects: int, opts: LayoutOptions | None = None, highlight: int | None = None
) -> list[Cell]:
    """Cells root first; a parent always comes before its children. Cells that only `suspects`
    reach are marked; those carrying `highlight` ranks (default: all suspects) stay visible."""
    highlight = suspects if highlight is None else highlight
    opts = opts or LayoutOptions()
    count, bits, children = tree.count, tree.bits, tree.children
    if not count or count[0] == 0:
        return []

    def is_suspect(b: int) -> bool:
        return bool(suspects) and b & ~suspects == 0

    cells = [Cell(0, 0, 0.0, opts.width, bits[0], count[0], suspect=is_suspect(bits[0]))]
    pending = [(0, 0.0, opts.width)]
    while pending:
        node, x, w = pending.pop()
        kids = children[node]
        if not kids:
            continue
        kids = sorted(kids, key=lambda k: (-count[k], ranksets.lowest(bits[k])))
        widths = _widths(tree, kids, w, count[node], highlight, opts)
        depth = tree.depth[node] + 1
        thin_bits = thin_count = thin_n = 0
        thin_w = 0.0
        for k, wk in zip(kids, widths, strict=True):
            if wk >= opts.min_width and wk > 0:
                cells.append(Cell(k, depth, x, wk, bits[k], count[k], suspect=is_suspect(bits[k])))
                pending.append((k, x, wk))
                x += wk
            else:
                thin_bits |= bits[k]
                thin_count += count[k]
                thin_n += 1
                thin_w += wk
        if thin_n and thin_w >= opts.min_width:
            cells.append(
                Cell(
                    OTHER,
                    depth,
                    x,
                    thin_w,
                    thin_bits,
                    thin_count,
                    merged=thin_n,
                    suspect=is_suspect(thin_bits),
                )
            )
    return cells
