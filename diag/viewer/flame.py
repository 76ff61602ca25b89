"""Renders a laid-out merged tree as a self-contained, interactive flame graph SVG.

No Perl and no network: the CSS and JS (flame.css, flame.js next to this module) are inlined.
Each frame is a `<g class="f k-KIND [s]">` with a `<title>` (the full label, its ranks and the
ranks without it), so hovering works even where scripts do not run; `s` marks frames that only
suspect ranks reach, drawn in red.
"""

from __future__ import annotations

import binascii
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from diag.viewer import ranksets
from diag.viewer.flamelayout import OTHER, Cell, LayoutSettings, layout
from diag.viewer.labels import FrameKind
from diag.viewer.tree import StackTree

PAD = 10  # left and right margins, px
CHAR_WIDTH = 6.95  # advance of an 11.5 px monospace glyph
HEADER_CHAR_WIDTH = 7.25  # of a 12 px one
TIP_RANGES = 48  # rank runs in a tooltip before it abbreviates
FOLDED_TIP = "folded frames, outermost first:"
FOLD_TIP_FRAMES = 40  # a folded cell's tooltip lists this many of its frames
SEARCH_RANGES = 4096  # rank runs kept per frame for `rank:N` search
HINT = (
    "width = ranks reaching a frame · hover: ranks · click: zoom, or expand ⋯ folded frames"
    " · Search / Ctrl-F: regex or rank:N"
)

# kind -> ((r lo, r hi), (g lo, g hi), (b lo, b hi)); a frame's name picks a shade within
PALETTE: dict[FrameKind, tuple[tuple[int, int], ...]] = {
    FrameKind.PYTHON: ((60, 110), (175, 215), (200, 235)),  # aqua
    FrameKind.NATIVE: ((225, 250), (170, 215), (40, 80)),  # yellow-orange
    FrameKind.TORCH: ((80, 130), (185, 225), (70, 110)),  # green
    FrameKind.STATE: ((170, 195), (130, 160), (225, 250)),  # purple
    FrameKind.THREAD: ((150, 170), (165, 185), (200, 220)),  # slate
    FrameKind.ROLE: ((175, 190), (180, 195), (195, 210)),  # light slate
    FrameKind.ROOT: ((190, 200), (190, 200), (190, 200)),
    FrameKind.OTHER: ((205, 215), (205, 215), (205, 215)),  # grey
}
SUSPECT = ((215, 250), (40, 90), (40, 80))  # red
LEGEND = (
    ("Python", PALETTE[FrameKind.PYTHON]),
    ("native", PALETTE[FrameKind.NATIVE]),
    ("torch/NCCL/gloo", PALETTE[FrameKind.TORCH]),
    ("thread", PALETTE[FrameKind.THREAD]),
    ("process state", PALETTE[FrameKind.STATE]),
    ("thin frames merged", PALETTE[FrameKind.OTHER]),
    ("suspect ranks only", SUSPECT),
)
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


@dataclass(frozen=True)
class FlameSettings:
    """How a flame SVG is drawn."""

    width: int = 1200
    frame_height: int = 16
    min_width: float = 0.1  # px; thinner frames merge into "other" cells
    suspect_min_width: float = 8.0  # px; frames carrying top suspects stay this wide


@dataclass(frozen=True)
class FlameHeader:
    """The text above a flame graph: title, lines, warnings in red."""

    title: str
    lines: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # drawn in red: the suspects


@cache
def _asset(name: str) -> str:
    # beside this module (package data); importlib.resources would add a tenth to start-up
    return Path(__file__).with_name(name).read_text()


def _x(text: str) -> str:
    """Text made safe for XML content and double-quoted attributes (what html.escape does,
    without importing html and its entity tables at every start)."""
    return (
        _XML_BAD.sub("?", text)
        .replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#x27;")
    )


def _shade(ranges: tuple[tuple[int, int], ...], key: str) -> str:
    # zlib's CRC-32; binascii is loaded already, zlib would be one import more
    h = binascii.crc32(key.encode("utf-8", "replace"))
    a, b = (h & 0xFFFF) / 0xFFFF, (h >> 16) / 0xFFFF
    (r0, r1), (g0, g1), (b0, b1) = ranges
    return (
        f"rgb({round(r0 + (r1 - r0) * a)},{round(g0 + (g1 - g0) * b)},{round(b0 + (b1 - b0) * a)})"
    )


def _fit(text: str, w: float) -> str:
    n = int((w - 6) / CHAR_WIDTH)
    if n < 3:
        return ""
    return text if len(text) <= n else text[: n - 2] + ".."


class _Cells:
    """Writes the cells of one graph; shares the rank-set table the search uses."""

    def __init__(self, tree: StackTree, inner: float, top: int, max_depth: int, fh: int):
        self.tree = tree
        self.scale = inner / (tree.count[0] or 1)  # px per stack without inflation
        self.top, self.max_depth, self.fh = top, max_depth, fh
        self.n_present = tree.present.bit_count()
        self.tips = ranksets.RankText(tree.present, TIP_RANGES)
        self.rank_index: dict[int, int] = {}
        self.rank_table: list[str] = []
        # per folded cell, its frames outermost first: [cell text, label, fill, kind]
        self.folds: list[list[list[str]]] = []

    def svg(self, c: Cell) -> str:
        tree = self.tree
        if c.node == OTHER:
            kind = FrameKind.OTHER
            text = f"other: {c.merged} thinner frames"
            short = f"other ({c.merged})"
        elif c.node == 0:
            kind = FrameKind.ROOT
            text = short = f"all: {self.n_present} ranks"
        elif c.folded:
            first, last = tree.info[c.folded[0]], tree.info[c.folded[-1]]
            kind = last.kind
            n = len(c.folded)
            text = f"{n} frames folded (click to expand): {first.text} … {last.text}"
            short = f"⋯ {n} frames: {last.short}"
        else:
            info = tree.info[c.node]
            kind, text, short = info.kind, info.text, info.short
        ri = self.rank_index.get(c.bits)
        if ri is None:
            ri = self.rank_index[c.bits] = len(self.rank_table)
            self.rank_table.append(ranksets.fold(c.bits, SEARCH_RANGES))
        n_ranks = c.bits.bit_count()
        stacks = f", {c.count} stacks" if c.count != n_ranks else ""
        tip = [
            text,
            f"{n_ranks} rank{'s' if n_ranks != 1 else ''} of {self.n_present}{stacks}: "
            f"{self.tips.fold(c.bits)}",
            f"without: {self.tips.fold(tree.present & ~c.bits) or 'none'}",
        ]
        if c.folded:
            tip.append(FOLDED_TIP)
            tip.extend("  " + tree.info[n].text for n in c.folded[:FOLD_TIP_FRAMES])
            if len(c.folded) > FOLD_TIP_FRAMES:
                tip.append(f"  ... {len(c.folded) - FOLD_TIP_FRAMES} more: click to expand")
        if c.suspect:
            tip.append("suspect frame: only suspect ranks reach it")
        if c.w > 1.05 * c.count * self.scale + 0.01:
            tip.append("drawn wider than its share of ranks, to stay visible")
        fill = _shade(SUSPECT if c.suspect else PALETTE[kind], text)
        cls = f"f k-{kind.value}" + (" s" if c.suspect else "")
        fold = ""
        if c.folded:
            cls += " fold"
            fold = f' data-fold="{len(self.folds)}"'
            self.folds.append(
                [
                    [
                        tree.info[n].short,
                        tree.info[n].text,
                        _shade(
                            SUSPECT if c.suspect else PALETTE[tree.info[n].kind], tree.info[n].text
                        ),
                        tree.info[n].kind.value,
                    ]
                    for n in c.folded
                ]
            )
        y = self.top + (self.max_depth - c.depth) * self.fh
        shown = _fit(short, c.w)
        extra = f' data-s="{_x(short)}"' if shown != short else ""
        return (
            f'<g class="{cls}" data-r="{ri}"{fold}{extra}><title>{_x(chr(10).join(tip))}</title>'
            f'<rect x="{PAD + c.x:.2f}" y="{y}" width="{c.w:.2f}" height="{self.fh - 1}" '
            f'fill="{fill}" rx="2"/>'
            f'<text x="{PAD + c.x + 3:.2f}" y="{y + self.fh - 4.5}">{_x(shown)}</text></g>\n'
        )


def render_svg(
    tree: StackTree,
    suspects: int,
    header: FlameHeader,
    opts: FlameSettings | None = None,
    highlight: int | None = None,
) -> str:
    """The flame graph of one view. `suspects`: bitset of the suspect ranks, whose own frames
    are drawn red; `highlight`: those kept visible at any scale (default: all suspects)."""
    opts = opts or FlameSettings()
    inner = opts.width - 2 * PAD
    cells = layout(
        tree,
        suspects,
        LayoutSettings(
            width=inner, min_width=opts.min_width, suspect_min_width=opts.suspect_min_width
        ),
        highlight,
    )
    fh = opts.frame_height
    top = 30 + 16 * (len(header.lines) + len(header.warnings)) + 24 + 22 + 8
    max_depth = max((c.depth for c in cells), default=0)
    height = top + (max_depth + 1) * fh + 34
    writer = _Cells(tree, inner, top, max_depth, fh)

    out = [
        '<?xml version="1.0" standalone="no"?>\n',
        f'<svg version="1.1" width="{opts.width}" height="{height}" '
        f'viewBox="0 0 {opts.width} {height}" xmlns="http://www.w3.org/2000/svg" '
        f'data-view="{tree.view.value}">\n',
        f"<style>{_asset('flame.css')}</style>\n",
        f'<rect class="bg" x="0" y="0" width="{opts.width}" height="{height}"/>\n',
        f'<text id="title" x="{opts.width / 2}" y="24">{_x(header.title)}</text>\n',
    ]
    y = 30
    fits = int((opts.width - 2 * PAD) / HEADER_CHAR_WIDTH)
    for cls, lines in (("sub", header.lines), ("sub warn", header.warnings)):
        for line in lines:
            y += 16
            shown = line if len(line) <= fits else line[: fits - 3] + "..."
            out.append(f'<text class="{cls}" x="{PAD}" y="{y}">{_x(shown)}</text>\n')
    y += 24
    out.append('<g class="legend">')
    lx = PAD
    for name, palette in LEGEND:
        out.append(
            f'<rect x="{lx}" y="{y - 10}" width="12" height="12" fill="{_shade(palette, name)}"/>'
            f'<text x="{lx + 16}" y="{y}">{_x(name)}</text>'
        )
        lx += 16 + len(name) * 7 + 18
    out.append("</g>\n")
    y += 22
    out.append(f'<text id="unzoom" class="btn hide" x="{PAD}" y="{y}">Reset Zoom</text>\n')
    out.append(f'<text id="search" class="btn" x="{opts.width - PAD - 50}" y="{y}">Search</text>\n')
    out.append('<g id="frames">\n')
    out.extend(writer.svg(c) for c in cells)
    out.append("</g>\n")
    out.append(f'<text id="details" x="{PAD}" y="{height - 12}"> </text>\n')
    out.append(f'<text id="matched" x="{opts.width - PAD}" y="{height - 12}"> </text>\n')
    meta = {
        "width": opts.width,
        "pad": PAD,
        "charWidth": CHAR_WIDTH,
        "hint": HINT,
        "view": tree.view.value,
        "ranks": writer.rank_table,
        "folds": writer.folds,
        "frameHeight": fh,
    }
    out.append(f'<script type="application/json" id="flame-meta">{_x(json.dumps(meta))}</script>\n')
    out.append(f'<script type="text/ecmascript"><![CDATA[\n{_asset("flame.js")}]]></script>\n')
    out.append("</svg>\n")
    return "".join(out)
