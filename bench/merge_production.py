"""The production-shaped incidents of bench/merge_bench.py, side by side with flamegraph.pl and
xpu_timer's viewer logic.

Incidents from bench/incidentgen/ (~15 Python and ~60 native threads per rank, gdb stacks up to
~200 frames with runs of `??`, helper threads that differ by timing and by thread counters, 3
odd ranks or none, 2 whole nodes and 2 scattered ranks without a dump, 2 corrupt files, a dump
that timed out), in each of the three formats `diag merge` reads and in both scenarios: `odd`
(three answering ranks stuck elsewhere) and `agree` (every answering rank waits in the same
place; the silent ranks and nodes are what to find). Per rank count and scenario:
- ours: `merge_incident` end to end on each format's files;
- xpu_timer's viewer logic (bench/xpu_timer_viewer.py) on the `.stacktrace` files: it stops at
  the corrupt files, as xpu_timer's does, so it is timed on the readable ones (`--skip-bad`);
- flamegraph.pl on the same stacks as per-rank folded input, one line per thread (the readable
  ranks' Python view and native view), merged and drawn by Perl: the same for every format;
- with `--xpu-timer-src`, xpu_timer's own viewer (bench/xpu_timer_own.py) on the readable
  `.stacktrace` files too.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import incidentgen as gen
from merge_measure import OURS, Run, flamegraph_pl, load_average, measured, summarize
from xpu_timer_own import XpuTimerOwn, readable

FORMATS = ("xpu", "diag", "pyspy")
SCENARIOS = ("odd", "agree")
ODD = 3
MISSING_NODES = 2
VIEWER = Path(__file__).resolve().parent / "xpu_timer_viewer.py"


@dataclass(frozen=True)
class Side:
    wall: float  # median s
    cpu: float  # median s, user + sys with children
    mib: float  # largest peak RSS of one process

    @classmethod
    def of(cls, runs: list[Run]) -> Side:
        wall, cpu, mib, _ = summarize(runs)
        return cls(wall, cpu, mib)


@dataclass(frozen=True)
class Row:
    world: int
    scenario: str
    fmt: str
    gib: float
    ours: Side
    xpu: Side | None  # xpu_timer's logic: on .stacktrace files only
    fg: Side  # flamegraph.pl, both views
    stages: dict[str, float]
    found: str  # "yes", or what went wrong
    flagged: int
    xpu_stops: bool | None  # xpu_timer's logic stops at the corrupt files
    load: str  # load average when the row was done
    own: Side | None = None  # xpu_timer's own viewer, from a DLRover checkout


def check(truth: gen.Truth, info: dict) -> str:
    """Whether ours found what was injected: the odd ranks first, then the silent ones; or,
    when the answering ranks agree, exactly the silent ones, at score 1; silent nodes named."""
    ranks = [r for r, _ in info["suspects"]]
    odd, silent = list(truth.odd_ranks), list(truth.unanswered)
    if odd:
        ok = sorted(ranks[: len(odd)]) == odd and sorted(ranks[len(odd) :]) == silent
    else:
        ok = sorted(ranks) == silent and all(s == 1.0 for _, s in info["suspects"])
    if not ok:
        return f"no: {ranks[:8]}"
    if info["nodes"] != list(truth.missing_nodes):
        return f"no: nodes {info['nodes']}"
    return "yes"


def _both_views(perl: str, fg: Path, folded: Path) -> Run:
    runs = [
        flamegraph_pl(perl, fg, sorted(folded.glob(f"{v}.*.folded")), folded / f"{v}.svg")
        for v in ("py", "cpp")
    ]
    return (sum(r[0] for r in runs), sum(r[1] for r in runs), max(r[2] for r in runs), b"")


def scenario_rows(
    root: Path,
    world: int,
    scenario: str,
    formats: tuple[str, ...],
    perl: str,
    fg: Path,
    repeat: int,
    clean: bool,
    own: XpuTimerOwn | None = None,
) -> list[Row]:
    """Every format of one incident shape: ours on each, xpu_timer's logic on `.stacktrace`
    files, flamegraph.pl once on the stacks, interleaved so that all meet the same load."""
    folded = root / f"folded-{world}-{scenario}"
    fg_runs: list[Run] = []
    rows = []
    for i, fmt in enumerate(formats):
        d = root / f"production-{world}-{scenario}-{fmt}"
        plan = gen.plan_incident(
            world, fmt=fmt, scenario=scenario, odd=ODD, missing_nodes=MISSING_NODES
        )
        truth = gen.write_incident(
            d, plan, workers=os.cpu_count() or 1, folded=folded if i == 0 else None
        )
        os.sync()  # let the writeback of the fresh dumps not land in the read times
        stops = None
        if fmt == "xpu":
            try:
                measured([sys.executable, str(VIEWER), str(d)])
                stops = False
            except RuntimeError:  # the corrupt files stop it, as they stop xpu_timer's
                stops = True
        ours_runs: list[Run] = []
        xpu_runs: list[Run] = []
        own_runs: list[Run] = []
        own_dir = (
            readable(d, root / f"readable-{world}-{scenario}") if own and fmt == "xpu" else None
        )
        for _ in range(repeat):
            ours_runs.append(
                measured([sys.executable, "-c", OURS, str(d), str(truth.local_world_size)])
            )
            if fmt == "xpu":
                cmd = [sys.executable, str(VIEWER), str(d), "--skip-bad", "--flamegraph", str(fg)]
                xpu_runs.append(measured(cmd))
            if own is not None and own_dir is not None:
                own_runs.append(measured(own.command(own_dir)))
            if i == 0:
                fg_runs.append(_both_views(perl, fg, folded))
        info = json.loads(summarize(ours_runs)[3])
        rows.append(
            Row(
                world=world,
                scenario=scenario,
                fmt=fmt,
                gib=sum(gen.iter_sizes(d)) / 2**30,
                ours=Side.of(ours_runs),
                xpu=Side.of(xpu_runs) if xpu_runs else None,
                fg=Side.of(fg_runs),
                stages=info["stages"],
                found=check(truth, info),
                flagged=len(info["suspects"]),
                xpu_stops=stops,
                load=load_average(),
                own=Side.of(own_runs) if own_runs else None,
            )
        )
        if clean:
            shutil.rmtree(d)
            if own_dir is not None:
                shutil.rmtree(own_dir)
    if clean:
        shutil.rmtree(folded)
    return rows


def print_rows(rows: list[Row], repeat: int) -> None:
    if not rows:
        return
    print("Production shape (ours: dumps -> 2 SVGs + 2 folded + summary; xpu_timer's logic: the")
    print("readable .stacktrace files -> 2 folded + 2 SVGs by flamegraph.pl; fg.pl: per-rank")
    print("folded stacks of both views -> 2 SVGs)")
    print(
        f"{'ranks':>6} {'scen.':<5} {'format':<6} {'GiB':>5} | {'ours s':>6} {'cpu':>6} "
        f"{'MiB':>5} | {'xpu s':>6} {'cpu':>6} {'MiB':>5} | {'fg.pl s':>7} {'cpu':>6} "
        f"{'MiB':>5} | {'xpu x':>5} {'fg x':>5} | found | flagged | load"
    )
    for r in rows:
        xpu = (
            f"{r.xpu.wall:>6.2f} {r.xpu.cpu:>6.2f} {r.xpu.mib:>5.0f}"
            if r.xpu
            else f"{'-':>6} {'-':>6} {'-':>5}"
        )
        xpu_x = f"{r.xpu.cpu / r.ours.cpu:>5.2f}" if r.xpu else f"{'-':>5}"
        print(
            f"{r.world:>6} {r.scenario:<5} {r.fmt:<6} {r.gib:>5.2f} | {r.ours.wall:>6.2f} "
            f"{r.ours.cpu:>6.2f} {r.ours.mib:>5.0f} | {xpu} | {r.fg.wall:>7.2f} {r.fg.cpu:>6.2f} "
            f"{r.fg.mib:>5.0f} | {xpu_x} {r.fg.cpu / r.ours.cpu:>5.2f} | {r.found:<5} | "
            f"{r.flagged:>4} ({100 * r.flagged / r.world:.2f}%) | {r.load}"
        )
    owned = [r for r in rows if r.own is not None]
    if owned:
        print("xpu_timer's own viewer (stack_viewer.py from the DLRover checkout, on the readable")
        print(".stacktrace files; flamegraph.pl draws its two views)")
        print(f"{'ranks':>6} {'scen.':<5} | {'own s':>6} {'cpu':>6} {'MiB':>5} | {'own x':>5}")
        for r in owned:
            assert r.own is not None
            print(
                f"{r.world:>6} {r.scenario:<5} | {r.own.wall:>6.2f} {r.own.cpu:>6.2f} "
                f"{r.own.mib:>5.0f} | {r.own.cpu / r.ours.cpu:>5.2f}"
            )
    for r in rows:
        st = r.stages
        stops = {None: "", True: "; xpu_timer's logic stops at the corrupt files"}.get(
            r.xpu_stops, "; xpu_timer's logic reads past the corrupt files"
        )
        print(
            f"  {r.world} {r.scenario} {r.fmt}, ours by stage (s): read {st['read']:.2f} merge "
            f"{st['merge']:.2f} draw {st['draw']:.2f} write {st['write']:.2f}{stops}"
        )
    print("x: the other side's CPU time divided by ours (above 1: ours does less); median of")
    print(f"{repeat} runs; CPU = user + sys of the process and its workers or children")
    print()
