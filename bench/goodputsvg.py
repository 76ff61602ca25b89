"""The goodput bench's picture, as SVG written by hand (no plotting library in the environment):
one panel per stack, step reached against wall time on a common time axis, each fault marked and
the time it cost shaded, part by part."""

from __future__ import annotations

from html import escape
from typing import Any

COLORS = {
    "trained again": "#f4a582",
    "detection": "#d6604d",
    "evidence": "#b2182b",
    "teardown": "#92c5de",
    "restart": "#4393c3",
    "restore": "#2166ac",
}
ORDER = ("trained again", "detection", "evidence", "teardown", "restart", "restore")
W, PANEL, LEFT, TOP, GAP = 960, 170, 70, 40, 50
CHAR_W = 6.2  # about the width of a character of the 11 px sans-serif labels


def draw(runs: dict[str, Any], steps: int, title: str) -> str:
    """`runs`: stack name -> RunTimes (goodputtimes.py), or a string saying why it did not run."""
    span = max([r.wall for r in runs.values() if not isinstance(r, str)] + [1.0])
    width = W - LEFT - 20
    height = TOP + len(runs) * (PANEL + GAP) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{W}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="20" font-size="14">{escape(title)}</text>',
    ]

    def x(t: float) -> float:
        return LEFT + width * t / span

    for i, (name, r) in enumerate(runs.items()):
        top = TOP + i * (PANEL + GAP)

        def y(step: float, top: int = top) -> float:
            return top + PANEL - PANEL * step / max(steps, 1)

        out.append(
            f'<rect x="{LEFT}" y="{top}" width="{width}" height="{PANEL}" fill="none" stroke="#888"/>'
        )
        if isinstance(r, str):
            out.append(f'<text x="{LEFT + 5}" y="{top - 6}" font-size="12">{escape(name)}</text>')
            out.append(f'<text x="{LEFT + 10}" y="{top + PANEL / 2}">{escape(r)}</text>')
            continue
        label = f"{name}: " + (r.unfinished or f"{r.wall:.0f} s, goodput {r.goodput:.1%}")
        out.append(f'<text x="{LEFT + 5}" y="{top - 6}" font-size="12">{escape(label)}</text>')
        ends = [float("-inf")] * 3  # where each row of fault labels is taken up to
        for loss in sorted(r.losses, key=lambda lo: lo.at):
            t = loss.at - r.t0 - loss.parts.get("trained again", 0.0)
            for part in ORDER:
                d = loss.parts.get(part, 0.0)
                if d > 0:
                    out.append(
                        f'<rect x="{x(t):.1f}" y="{top}" width="{max(0.5, x(t + d) - x(t)):.1f}" '
                        f'height="{PANEL}" fill="{COLORS[part]}" fill-opacity="0.55"/>'
                    )
                t += d
            fx = x(loss.at - r.t0)
            out.append(
                f'<line x1="{fx:.1f}" y1="{top}" x2="{fx:.1f}" y2="{top + PANEL}" stroke="black" '
                f'stroke-dasharray="3,2"/>'
            )
            note = loss.fault.kind + ("" if loss.restored is not None else " (not recovered)")
            # Faults close together: the next label goes a row lower rather than over the last.
            row = next((i for i, e in enumerate(ends) if fx + 2 >= e), 0)
            ends[row] = fx + 2 + CHAR_W * len(note) + 4
            out.append(f'<text x="{fx + 2:.1f}" y="{top + 12 + 13 * row}">{escape(note)}</text>')
        pts = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in r.curve)
        out.append(f'<polyline points="{pts}" fill="none" stroke="black" stroke-width="1.5"/>')
        out.append(f'<text x="{LEFT - 8}" y="{top + 10}" text-anchor="end">{steps}</text>')
        out.append(f'<text x="{LEFT - 8}" y="{top + PANEL}" text-anchor="end">0</text>')
        out.append(
            f'<text x="14" y="{top + PANEL / 2}" transform="rotate(-90 14 {top + PANEL / 2})" '
            f'text-anchor="middle">step</text>'
        )
    base = TOP + len(runs) * (PANEL + GAP) - GAP + 14
    tick = max(10, round(span / 10, -1))
    t = 0.0
    while t <= span:
        out.append(f'<text x="{x(t):.1f}" y="{base}" text-anchor="middle">{t:.0f}</text>')
        t += tick
    out.append(
        f'<text x="{LEFT + width / 2}" y="{base + 14}" text-anchor="middle">wall time (s)</text>'
    )
    lx = LEFT
    for part in ORDER:
        out.append(
            f'<rect x="{lx}" y="{base + 20}" width="12" height="10" fill="{COLORS[part]}" '
            f'fill-opacity="0.55"/>'
        )
        out.append(f'<text x="{lx + 16}" y="{base + 29}">{part}</text>')
        lx += 130
    out.append("</svg>")
    return "\n".join(out) + "\n"
