"""Where each frame of a merged tree goes in the flame graph.

Widths are proportional to the number of stacks through a frame (ranks, one per thread), with
departures for scale and for reading:
- at the first level the ranks count, not the threads: the training threads and the towers of
  ranks without stacks share the width by ranks, and the helper threads (data loaders, loggers,
  RPC pollers...; 60 of them per rank in a native dump) are drawn in a band of at most
  `helper_share` of the width, so that one helper thread per rank cannot take half the picture;
- frames thinner than `min_width` pixels are merged, per parent, into one "other" cell (dropped
  when even that is too thin), as flamegraph.pl's --minwidth drops them, so that the file stays
  small at any rank count;
- frames that carry one of the top suspect ranks (`highlight`) are drawn at least
  `suspect_min_width` pixels wide, and the towers of ranks without a dump at least
  `marker_min_width`, their siblings giving up the room: one odd rank among 16k would otherwise
  be 0.07 px wide and vanish. Tooltips give the true counts.

Heights: a run of frames that every stack through it shares (one child after another, no stack
ending in between) is folded into one cell (`Cell.folded`), its innermost frame left standing on
its own: a 200-frame native stack whose ranks all agree takes two rows, and the rows that remain
are the places where stacks part. When even that leaves more than `max_rows`, runs of two fold
too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from diag.viewer import ranksets
from diag.viewer.labels import FrameKind
from diag.viewer.roles import Role
from diag.viewer.tree import StackTree

OTHER = -1  # the node of an "other" cell
FRAME_KINDS = frozenset({FrameKind.PYTHON, FrameKind.NATIVE, FrameKind.TORCH})
TRAINING_ROLE = f"Role@{Role.TRAINING.value}"


@dataclass(frozen=True)
class LayoutSettings:
    """Sizes and limits of a flame graph's layout."""

    width: float = 1180.0  # pixels for the whole tree
    min_width: float = 0.1
    suspect_min_width: float = 8.0
    marker_min_width: float = 60.0  # ranks without stacks: a missing node, unreadable dumps
    helper_share: float = 0.2  # of the width, at most, for the helper threads
    fold_min: int = 3  # shortest run of shared frames folded into one cell
    max_rows: int = 60  # above this, runs of two fold too


@dataclass(frozen=True)
class Cell:
    """One drawn cell of a flame graph: a tree node (or several folded) at a row and an x range."""

    node: int  # tree node (the innermost of `folded`), or OTHER
    depth: int  # row, 0 for the root
    x: float
    w: float
    bits: int  # ranks that reach it
    count: int  # stacks through it
    merged: int = 1  # frames an "other" cell stands for
    suspect: bool = False  # every rank that reaches it is a suspect
    folded: tuple[int, ...] = ()  # the tree nodes a folded cell stands for, outermost first


def is_helper(tree: StackTree, node: int) -> bool:
    info = tree.info[node]
    return info.kind is FrameKind.ROLE and info.text != TRAINING_ROLE


def is_marker(tree: StackTree, node: int) -> bool:
    """A first-level cell of ranks without stacks: no dump, an unreadable one, no native stack."""
    return tree.parent[node] == 0 and tree.info[node].kind is FrameKind.STATE


def _natural(tree: StackTree, node: int, kids: list[int], w: float, opts: LayoutSettings):
    count = tree.count
    if node != 0:
        scale = w / count[node]
        return [count[k] * scale for k in kids]
    helpers = [is_helper(tree, k) for k in kids]
    main = sum(tree.bits[k].bit_count() for k, h in zip(kids, helpers, strict=True) if not h)
    aux = sum(count[k] for k, h in zip(kids, helpers, strict=True) if h)
    if not main or not aux:
        scale = w / (main or aux)
        return [
            (count[k] if h else tree.bits[k].bit_count()) * scale
            for k, h in zip(kids, helpers, strict=True)
        ]
    share = min(opts.helper_share, aux / (aux + main))
    main_scale, aux_scale = w * (1 - share) / main, w * share / aux
    return [
        count[k] * aux_scale if h else tree.bits[k].bit_count() * main_scale
        for k, h in zip(kids, helpers, strict=True)
    ]


def _widths(
    tree: StackTree, node: int, kids: list[int], w: float, highlight: int, opts: LayoutSettings
) -> list[float]:
    natural = _natural(tree, node, kids, w, opts)
    bits = tree.bits
    want = []
    for k, n in zip(kids, natural, strict=True):
        least = 0.0
        if highlight and bits[k] & highlight:
            least = opts.suspect_min_width
        if node == 0 and is_marker(tree, k):
            least = max(least, opts.marker_min_width)
        want.append(max(n, least) if least else -1.0)
    if all(wn < 0 for wn in want):
        return natural
    wanted = sum(wn for wn in want if wn >= 0)
    rest = sum(n for n, wn in zip(natural, want, strict=True) if wn < 0)
    if wanted >= w:
        return [wn * w / wanted if wn >= 0 else 0.0 for wn in want]
    # the others (and the parent's own stacks, which keep their share) give up the room
    free = w - wanted - (w - sum(natural))
    shrink = max(free, 0.0) / rest if rest > 0 else 0.0
    return [wn if wn >= 0 else n * shrink for wn, n in zip(want, natural, strict=True)]


def _run(tree: StackTree, node: int) -> list[int]:
    """The frames from `node` up that every stack through `node` shares: one child after
    another, none of them ending a stack, ending in the last such frame."""
    run = [node]
    children, own, info = tree.children, tree.own, tree.info
    while own[node] == 0 and len(children[node]) == 1:
        child = children[node][0]
        if info[child].kind not in FRAME_KINDS:
            break
        run.append(child)
        node = child
    return run


def layout(
    tree: StackTree, suspects: int, opts: LayoutSettings | None = None, highlight: int | None = None
) -> list[Cell]:
    """Cells root first; a parent always comes before its children. Cells that only `suspects`
    reach are marked; those carrying `highlight` ranks (default: all suspects) stay visible."""
    opts = opts or LayoutSettings()
    cells = _layout(tree, suspects, opts, highlight)
    if opts.fold_min > 2 and max((c.depth for c in cells), default=0) >= opts.max_rows:
        cells = _layout(tree, suspects, replace(opts, fold_min=2), highlight)
    return cells


def _layout(
    tree: StackTree, suspects: int, opts: LayoutSettings, highlight: int | None
) -> list[Cell]:
    highlight = suspects if highlight is None else highlight
    count, bits, children, info = tree.count, tree.bits, tree.children, tree.info
    if not count or count[0] == 0:
        return []

    def is_suspect(b: int) -> bool:
        return bool(suspects) and b & ~suspects == 0

    cells = [Cell(0, 0, 0.0, opts.width, bits[0], count[0], suspect=is_suspect(bits[0]))]
    pending = [(0, 0, 0.0, opts.width)]  # (node, row, x, width)
    while pending:
        node, row, x, w = pending.pop()
        kids = children[node]
        if not kids:
            continue
        kids = sorted(kids, key=lambda k: (-count[k], ranksets.lowest(bits[k])))
        if node == 0:  # training threads and missing ranks first, then the helpers' band
            kids.sort(key=lambda k: is_helper(tree, k))
        widths = _widths(tree, node, kids, w, highlight, opts)
        row += 1
        thin_bits = thin_count = thin_n = 0
        thin_w = 0.0
        for k, wk in zip(kids, widths, strict=True):
            if wk >= opts.min_width and wk > 0:
                suspect = is_suspect(bits[k])
                top, kid_row = k, row
                if info[k].kind in FRAME_KINDS:
                    run = _run(tree, k)
                    if len(run) > opts.fold_min:  # the innermost stands on its own
                        cells.append(
                            Cell(
                                run[-2],
                                row,
                                x,
                                wk,
                                bits[k],
                                count[k],
                                suspect=suspect,
                                folded=tuple(run[:-1]),
                            )
                        )
                        top, kid_row = run[-1], row + 1
                cells.append(Cell(top, kid_row, x, wk, bits[k], count[k], suspect=suspect))
                pending.append((top, kid_row, x, wk))
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
                    row,
                    x,
                    thin_w,
                    thin_bits,
                    thin_count,
                    merged=thin_n,
                    suspect=is_suspect(thin_bits),
                )
            )
    return cells
