"""The first flash save of a launch: diag on a fresh launch and on a relaunch, against DLRover's
first save on the same engine, side by side in one run (`flash_checkpoint.py --first-save`).

    .venv/bin/python bench/flash_checkpoint.py --first-save --repeats 3

Runs --repeats + 1 launches of the bench's DeepSpeed job, one after another, sharing one run
directory (as the launches of a restarted job on one node share /dev/shm). In each launch, in an
order that rotates from launch to launch (whoever goes first may pay for reclaiming page cache):
- diag, fresh: a checkpointer of a job name no launch used before (no slots): its first save;
- diag, relaunch: a checkpointer of the job name every launch uses, whose slots the previous
  launch left (closed without removing them, as a failed launch leaves them): its first save,
  then a second save (the steady state, for reference). The first launch has no previous one:
  its relaunch sample is left out;
- DLRover: a DeepSpeedCheckpointer's first save to memory, its saver (a process of its own, as
  dlrover-run's agent hosts it) started fresh for the launch.
A first save is timed from a barrier to the end of its copy into shared memory, the slowest
rank's time. Checkpointer start-up and diag's background allocation of a fresh launch's other
slot are timed apart. Prints medians with ratios to DLRover, and every launch's figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RELAUNCH_JOB = "bench-flash-relaunch"


def launch(args: argparse.Namespace, engine: Any, slowest: Any, timed: Any) -> int:
    """One launch, on every rank: the first saves, in this launch's order."""
    import torch.distributed as dist
    from flash_checkpoint import dlrover_flash

    import diag.trainer
    from diag.formats.rundir import default_run_dir
    from diag.formats.snapshot import slot_path

    k, out = args.launch, args.worker
    rank = dist.get_rank()
    got: dict[str, Any] = {"launch": k}
    made: dict[str, Any] = {}

    def start(name: str, job: str) -> None:
        made[name] = diag.trainer.FlashCheckpointer(engine, out / name, job=job, control=False)

    def first_save(name: str, step: int) -> None:
        made[name].save(step)
        made[name].wait()

    def fresh() -> None:
        got["fresh_start"] = timed(lambda: start("fresh", f"bench-flash-fresh{k}"))
        got["fresh"] = timed(lambda: first_save("fresh", 1))
        # Older diag allocated every slot at the first save: nothing left to wait for.
        rest = getattr(made["fresh"], "wait_slots", made["fresh"].wait)
        got["fresh_rest"] = timed(rest)
        got["bytes"] = made["fresh"].stats.last_save_bytes
        made.pop("fresh").close(remove=True)

    def relaunch() -> None:
        left = sum(slot_path(default_run_dir(), RELAUNCH_JOB, rank, i).exists() for i in (0, 1))
        got["relaunch_slots_found"] = int(slowest(-left)) * -1  # the fewest of any rank
        got["relaunch_start"] = timed(lambda: start("relaunch", RELAUNCH_JOB))
        got["relaunch"] = timed(lambda: first_save("relaunch", 10 * k + 1))
        got["relaunch_second"] = timed(lambda: first_save("relaunch", 10 * k + 2))
        made.pop("relaunch").close(remove=False)  # left for the next launch

    def dlrover() -> None:
        dl = dlrover_flash(engine, out, timed, 0)
        got["dlrover"] = dl.get("first_save")
        got["dlrover_error"] = dl.get("error", "")

    steps = {"fresh": fresh, "relaunch": relaunch, "dlrover": dlrover}
    order = list(steps)[k % 3 :] + list(steps)[: k % 3]
    if not args.dlrover:
        order.remove("dlrover")
    got["order"] = order
    for name in order:
        steps[name]()
    sizes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, got["bytes"])
    got["bytes_per_rank"] = sizes
    if rank == 0:
        (out / f"launch{k}.json").write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def drive(args: argparse.Namespace) -> int:
    from flash_checkpoint import _free_port, dlrover_cleanup, start_dlrover_saver

    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("--gpu: no CUDA device here", file=sys.stderr)
            return 2
        args.nproc = min(args.nproc, torch.cuda.device_count())
    if args.dlrover is None:
        args.dlrover = True
    bench = str(Path(__file__).with_name("flash_checkpoint.py"))
    work = Path(tempfile.mkdtemp(prefix="bench-flash-first-", dir=args.disk_dir))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-flash-first-run-", dir="/dev/shm"))
    launches = []
    try:
        env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_CONTROL="0")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.nproc)))
        for k in range(args.repeats + 1):
            run_id = f"bench-flash-first-{os.getpid()}-{k}"
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(args.nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                "--rdzv-id", run_id, bench, "--worker", str(work), "--launch", str(k),
                "--params-m", str(args.params_m), *(["--gpu"] if args.gpu else []),
                "--dlrover" if args.dlrover else "--no-dlrover",
            ]  # fmt: skip
            saver = start_dlrover_saver(run_id, env) if args.dlrover else None
            try:
                subprocess.run(cmd, env=env, check=True)
            finally:
                if args.dlrover:
                    dlrover_cleanup(run_id, saver)
            launches.append(json.loads((work / f"launch{k}.json").read_text()))
        report(args, launches)
        if args.json is not None:
            args.json.write_text(json.dumps(launches, indent=1))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(args: argparse.Namespace, launches: list[dict]) -> None:
    med = statistics.median
    gb = 1e9
    total = sum(launches[0]["bytes_per_rank"])
    largest = max(launches[0]["bytes_per_rank"])
    relaunched = [x for x in launches[1:] if x["relaunch_slots_found"] == 2]

    def m(key: str, rows: list[dict]) -> float | None:
        vals = [x[key] for x in rows if x.get(key) is not None]
        return med(vals) if vals else None

    dl = m("dlrover", launches)
    print(
        f"\nfirst flash save of a launch, {dt.date.today()}, {platform.node()}, "
        f"{os.cpu_count()} cores, {'cuda' if args.gpu else 'cpu'}, {args.nproc} ranks, "
        f"ZeRO-2 fp32 Adam, {total / gb:.2f} GB of checkpoint state (largest rank "
        f"{largest / gb:.2f} GB); median of {len(launches)} launches ({len(relaunched)} "
        f"relaunches), slowest rank, barrier to copy complete\n"
    )
    rows = [
        ("diag, fresh launch (reserves both slots, maps one)", m("fresh", launches)),
        ("diag, relaunch (the previous launch's slots)", m("relaunch", relaunched)),
        ("DLRover, fresh launch", dl),
        ("diag, the relaunch's second save (steady state)", m("relaunch_second", relaunched)),
    ]
    print(f"| {'first save of a launch':<52} | {'seconds':>8} | {'GB/s':>6} | / DLRover |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 8}|-----------|")
    for name, s in rows:
        if s is None:
            print(f"| {name:<52} | {'-':>8} | {'-':>6} | - |")
            continue
        ratio = f"{s / dl:.2f}" if dl else "-"
        print(f"| {name:<52} | {s:8.3f} | {largest / gb / s:6.2f} | {ratio} |")
    print("\noff the first save's path (not in the figures above):")
    for name, key, rows_ in (
        ("diag, fresh: the other slot, mapped in the background", "fresh_rest", launches),
        ("diag, fresh: checkpointer start", "fresh_start", launches),
        ("diag, relaunch: checkpointer start (adopts its slots)", "relaunch_start", relaunched),
    ):
        s = m(key, rows_)
        print(f"  {name}: {'-' if s is None else f'{s:.3f} s'}")
    errors = {x["dlrover_error"] for x in launches if x.get("dlrover_error")}
    if errors:
        print(f"\nDLRover's first save: not measured in some launches: {'; '.join(errors)}")
    print("\nevery launch (seconds; order of the measurements):")
    for x in launches:
        fields = ("fresh", "relaunch", "dlrover", "relaunch_start")
        vals = ", ".join(
            f"{f} {x[f]:.3f}" if isinstance(x.get(f), float) else f"{f} -" for f in fields
        )
        note = "" if x["relaunch_slots_found"] == 2 else " (no slots left before: not a relaunch)"
        print(f"  launch {x['launch']}: {vals}; order {'/'.join(x['order'])}{note}")
