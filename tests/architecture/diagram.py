"""The rooms of diag and the imports between them, as the mermaid flowchart of
docs/architecture.md, drawn from the import graph of the source.

    .venv/bin/python tests/architecture/diagram.py --write   # redraws the page's diagram
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import importgraph
import layers

PAGE = importgraph.REPO / "docs" / "architecture.md"
BEGIN = "<!-- rooms: drawn by tests/architecture/diagram.py --write; do not edit by hand -->"
END = "<!-- /rooms -->"


def mermaid(edges: set[tuple[str, str]]) -> str:
    """The flowchart: one node per room, one arrow per room that imports another."""
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {room}[{room}]" for room in layers.ROOMS]
    lines += [f"    {a} --> {b}" for a, b in sorted(edges)]
    lines.append("```")
    return "\n".join(lines)


def current() -> str:
    return mermaid(set(importgraph.room_edges(importgraph.repo_modules())))


def block_of(page: str) -> str:
    """The diagram between the page's markers; ValueError when they are missing."""
    start = page.index(BEGIN) + len(BEGIN)
    return page[start : page.index(END, start)].strip("\n")


def rewrite(page: str, block: str) -> str:
    start = page.index(BEGIN) + len(BEGIN)
    end = page.index(END, start)
    return f"{page[:start]}\n{block}\n{page[end:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the diagram in {PAGE}")
    args = parser.parse_args()
    block = current()
    if not args.write:
        print(block)
        return 0
    page = Path(PAGE).read_text()
    try:
        Path(PAGE).write_text(rewrite(page, block))
    except ValueError:
        print(f"{PAGE}: no {BEGIN!r} ... {END!r} markers to write between", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
