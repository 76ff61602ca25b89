"""xpu_timer's stack viewer logic, rebuilt for side-by-side timing (`bench/merge_bench.py`).

xpu_timer (not on PyPI) ships `xpu_timer_stacktrace_viewer`, which merges the per-rank
`.stacktrace` files of a directory the way this script does (described in
/work/shared/reference: its own source is not copied here):
- the world size comes from the first file name, every file is parsed with the protobuf runtime
  once per mode (`cpp`: the gdb threads; `py`: the py-spy threads);
- each thread's frames, root first, labelled `func@file`, go into a prefix trie whose nodes keep
  the set of ranks through them (a frame containing `lto_priv` ends the stack); each rank also
  gets a one-frame stack `State@<process state>`;
- the trie is written as folded stacks, every frame labelled `@<ranks with>|<ranks without>`
  with consecutive ranks folded (`0-5/7`), and flamegraph.pl draws each mode (`--width 1600`).
It stops at the first file that does not parse, as xpu_timer's does; `--skip-bad` goes on.

    python bench/xpu_timer_viewer.py DIR [--flamegraph PATH] [--skip-bad]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from google.protobuf.message import DecodeError

from diag.proto import hosting_service_pb2


class Node:
    __slots__ = ("ends", "kids", "ranks")

    def __init__(self) -> None:
        self.kids: dict[str, Node] = {}
        self.ranks: set[int] = set()
        self.ends = False


def fold(ranks: list[int]) -> str:
    runs: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        runs.append(str(start) if start == prev else f"{start}-{prev}")
    return "/".join(runs)


def insert(root: Node, words: list[str], rank: int) -> None:
    node = root
    for w in words:
        if "lto_priv" in w:
            break
        nxt = node.kids.get(w)
        if nxt is None:
            nxt = node.kids[w] = Node()
        node = nxt
        node.ranks.add(rank)
    node.ends = True
    node.ranks.add(rank)


def folded(root: Node, everyone: set[int]):
    pending = [(root, [])]
    while pending:
        node, path = pending.pop()
        for word, kid in node.kids.items():
            label = f"{word}@{fold(list(kid.ranks))}|{fold(list(everyone - kid.ranks))}"
            here = [*path, label]
            if kid.ends:
                yield ";".join(here)
            pending.append((kid, here))


def merge(directory: Path, mode: str, skip_bad: bool) -> Path:
    files = sorted(directory.glob("*stacktrace"))
    if not files:
        raise SystemExit(f"no stacktrace files in {directory}")
    world = int(files[0].name[6:11])
    everyone = set(range(world))
    root = Node()
    for f in files:
        rank = int(f.name[:5])
        st = hosting_service_pb2.Stacktrace()
        try:
            st.ParseFromString(f.read_bytes())
        except DecodeError:
            if not skip_bad:
                raise
            continue
        insert(root, [f"State@{st.process_state}"], rank)
        threads = st.stacktrace if mode == "cpp" else st.py_stacktrace
        for t in threads:
            insert(root, [f"{fr.func_name}@{fr.file_name}" for fr in reversed(t.frames)], rank)
    out = directory / f"xpu_{mode}_stack"
    with open(out, "w") as fh:
        for line in folded(root, everyone):
            fh.write(f"{line} 1\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--flamegraph", help="flamegraph.pl to draw with (none: folded files only)")
    ap.add_argument("--skip-bad", action="store_true")
    args = ap.parse_args()
    for mode in ("cpp", "py"):
        out = merge(args.path, mode, args.skip_bad)
        if args.flamegraph:
            with open(out.with_suffix(".svg"), "wb") as svg, open(out, "rb") as src:
                subprocess.run(
                    [
                        "perl",
                        args.flamegraph,
                        "--width",
                        "1600",
                        "--title",
                        f"merge stack in {mode}",
                    ],
                    stdin=src,
                    stdout=svg,
                    check=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
