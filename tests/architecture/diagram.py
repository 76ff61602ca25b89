"""The rooms of diag and the imports between them, and inside the agent and the trainer their
sub-rooms, as the mermaid flowcharts of docs/architecture.md, drawn from the import graph of the
source.

    .venv/bin/python tests/architecture/diagram.py --write   # redraws the page's diagrams
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import importgraph
import layers

PAGE = importgraph.REPO / "docs" / "architecture.md"


@dataclass(frozen=True)
class Drawing:
    """One diagram of the page, between its markers."""

    begin: str
    end: str


ROOMS = Drawing(
    "<!-- rooms: drawn by tests/architecture/diagram.py --write; do not edit by hand -->",
    "<!-- /rooms -->",
)
SUB_ROOMS = Drawing(
    "<!-- sub-rooms: drawn by tests/architecture/diagram.py --write; do not edit by hand -->",
    "<!-- /sub-rooms -->",
)


def mermaid(edges: set[tuple[str, str]]) -> str:
    """The flowchart: one node per room, one arrow per room that imports another."""
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {room}[{room}]" for room in layers.ROOMS]
    lines += [f"    {a} --> {b}" for a, b in sorted(edges)]
    lines.append("```")
    return "\n".join(lines)


def _node(sub_room: str) -> str:
    # agent.detect -> agent_detect: a mermaid id is one word.
    return sub_room.replace(".", "_")


# Closer layers than mermaid's default (50 px apart): the words stay at a readable size when the
# drawing is scaled down to the page's width.
SPACING = ("---", "config:", "  flowchart:", "    rankSpacing: 25", "    nodeSpacing: 20", "---")


def mermaid_sub_rooms(edges: set[tuple[str, str]]) -> str:
    """A flowchart per room with sub-rooms, under its name: one node per sub-room, one arrow per
    sub-room that imports another of its room. Left to right: the imports are a few layers deep
    and the sub-rooms many, so each drawing stays narrow enough to read on a page."""
    out = []
    for room, subs in layers.SUB_ROOMS.items():
        lines = [f"**{room}**", "", "```mermaid", *SPACING, "flowchart LR"]
        lines += [f"    {_node(f'{room}.{sub}')}[{sub}]" for sub in subs]
        lines += [
            f"    {_node(a)} --> {_node(b)}" for a, b in sorted(edges) if a.split(".")[0] == room
        ]
        lines.append("```")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def current() -> str:
    return mermaid(set(importgraph.room_edges(importgraph.repo_modules())))


def current_sub_rooms() -> str:
    return mermaid_sub_rooms(set(importgraph.sub_room_edges(importgraph.repo_modules())))


def block_of(page: str, drawing: Drawing = ROOMS) -> str:
    """The diagram between the page's markers; ValueError when they are missing."""
    start = page.index(drawing.begin) + len(drawing.begin)
    return page[start : page.index(drawing.end, start)].strip("\n")


def rewrite(page: str, block: str, drawing: Drawing = ROOMS) -> str:
    start = page.index(drawing.begin) + len(drawing.begin)
    end = page.index(drawing.end, start)
    return f"{page[:start]}\n{block}\n{page[end:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the diagrams in {PAGE}")
    args = parser.parse_args()
    blocks = [(ROOMS, current()), (SUB_ROOMS, current_sub_rooms())]
    if not args.write:
        print("\n\n".join(block for _, block in blocks))
        return 0
    page = Path(PAGE).read_text()
    for drawing, block in blocks:
        try:
            page = rewrite(page, block, drawing)
        except ValueError:
            print(
                f"{PAGE}: no {drawing.begin!r} ... {drawing.end!r} markers to write between",
                file=sys.stderr,
            )
            return 1
    Path(PAGE).write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
