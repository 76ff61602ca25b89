"""The shape of a real node, kept on one machine for a bench: the ranks and the agents on CPUs of
their own, CPU seconds of a process tree, and a page cache as cold as a replaced node's."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

from polling import idle_for, tree_cpu_seconds  # tests/support, on the path of the benches


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset takes it: "1", "0,2", "0-3"."""
    out: set[int] = set()
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        try:
            out.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a CPU list: {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r}")
    return frozenset(out)


def cpu_list(cpus: frozenset[int] | None) -> str:
    return "any" if cpus is None else ",".join(str(c) for c in sorted(cpus))


def pinned(cpus: frozenset[int] | None):
    """A preexec_fn that pins the child (and so every thread and process it starts) to `cpus`."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def cpu_seconds(p: subprocess.Popen) -> float:
    """User and system CPU seconds of a process and its live children."""
    return tree_cpu_seconds(p.pid)


def cached_bytes(root: Path) -> int | None:
    """Bytes of the files under `root` in the page cache (util-linux fincore), or None."""
    files = [str(f) for f in root.rglob("*") if f.is_file() and not f.is_symlink()]
    if not files:
        return 0
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                         capture_output=True, text=True, check=False)  # fmt: skip
    try:
        return sum(int(x) for x in out.stdout.split())
    except ValueError:
        return None


def evict(root: Path) -> None:
    """Writes back and drops from the page cache every file under `root`: what a replaced node,
    which never read them, has of them."""
    for f in root.rglob("*"):
        if f.is_symlink() or not f.is_file():
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def settled(procs: list[subprocess.Popen]) -> bool:
    """Whether the processes are idle, waiting for their go file (0.05 s of CPU in 1 s)."""
    return idle_for([p.pid for p in procs])
