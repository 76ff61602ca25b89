"""Per-step cost of the stop-flag agreement of `diag.trainer.graceful_exit`, against the same job
without it, side by side in one run.

    .venv/bin/python bench/stop_flag_bench.py                # 2 ranks, three model sizes

One torchrun job per model size: a DeepSpeed ZeRO-2 engine (gloo, CPU, fp32 Adam) with
`graceful_exit` hooked on it, trained in blocks of steps that rotate between three modes:
- `off`: the hook is there but never agrees (the reference: the job without the agreement);
- `every step`: an agreement at every step boundary (what ms-swift's graceful exit does);
- `adaptive`: the default period (diag.trainer.period: as often as a 1% cost budget allows,
  at most 10 s between agreements).
Every rank times each block between two barriers; the slowest rank's time counts. Also measured
in the same job: the agreement alone (the five-number all-reduce, many times in a row), which
is the `c` of the scaling arithmetic in BENCHMARKS.md. Prints a table of per-step times and
ratios against `off`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"tiny": 32, "small": 256, "medium": 1024}  # hidden width of a 2-layer MLP
MODES = ("off", "every step", "adaptive")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small,medium", help=f"of {sorted(SIZES)}")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--blocks", type=int, default=8, help="blocks per mode")
    p.add_argument("--block-steps", type=int, default=40)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> int:
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from diag.trainer.commands import Agreement, agree
    from diag.trainer.graceful import GracefulExit
    from diag.trainer.period import AgreementPeriod, PeriodPolicy

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    h = SIZES[args.size]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
    )
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), dist_init_required=False,
        config={"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}},
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as save:
        drain = GracefulExit(engine, save, stop_file="", signals=())
        periods = {
            "every step": AgreementPeriod(PeriodPolicy(every=1)),
            "adaptive": AgreementPeriod(PeriodPolicy()),
        }
        x = torch.randn(8, h)

        def run(steps: int) -> None:
            for _ in range(steps):
                loss = (engine(x) - x).pow(2).mean()
                engine.backward(loss)
                engine.step()

        run(10)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in MODES}
        agreements = {m: 0 for m in MODES}
        for b in range(args.blocks):
            for i in range(len(MODES)):
                mode = MODES[(b + i) % len(MODES)]  # rotate the order: no mode always first
                drain.enabled = mode != "off"
                if mode != "off":
                    drain.period = periods[mode]
                before = drain.period.agreements
                dist.barrier()
                t0 = time.perf_counter()
                run(args.block_steps)
                elapsed = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[mode].append(elapsed.item() / args.block_steps)
                if mode != "off":
                    agreements[mode] += drain.period.agreements - before
        # The agreement alone.
        local = Agreement(False, False, 0)
        for _ in range(20):
            agree(local, drain._group, dist.get_world_size())
        n = 500
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            agree(local, drain._group, dist.get_world_size())
        alone = (time.perf_counter() - t0) / n
        drain.flag.uninstall()
    if rank == 0:
        steps = args.blocks * args.block_steps
        args.result.write_text(
            json.dumps(
                {
                    "step_s": {m: statistics.median(v) for m, v in times.items()},
                    "agreements_per_100": {m: 100 * agreements[m] / steps for m in MODES},
                    "adaptive_every": periods["adaptive"].every,
                    "agree_alone_s": alone,
                }
            )
        )
    dist.destroy_process_group()
    return 0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        from diag.trainer import exit_process

        exit_process(worker(args))
    rows = []
    for size in args.sizes.split(","):
        if size not in SIZES:
            print(f"unknown size {size!r}: choose from {', '.join(SIZES)}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(args.ranks), "--master-addr", "127.0.0.1", "--master-port", str(_port()),
                __file__, "--worker", "--size", size, "--result", str(result),
                "--blocks", str(args.blocks), "--block-steps", str(args.block_steps),
            ]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1", DIAG_CONTROL="0")
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append((size, json.loads(result.read_text())))
    print(f"# {dt.date.today()} {platform.node()} {os.cpu_count()} CPUs, {args.ranks} ranks, "
          f"gloo; {args.blocks} blocks x {args.block_steps} steps per mode, median per-step "
          "time of the slowest rank")  # fmt: skip
    print("| model | mode | step ms | ratio to off | agreements per 100 steps |")
    print("|---|---|---|---|---|")
    for size, r in rows:
        off = r["step_s"]["off"]
        for mode in MODES:
            s = r["step_s"][mode]
            print(f"| {size} (hidden {SIZES[size]}) | {mode} | {s * 1e3:.2f} | {s / off:.4f} | "
                  f"{r['agreements_per_100'][mode]:.1f} |")  # fmt: skip
    for size, r in rows:
        print(f"{size}: one agreement alone {r['agree_alone_s'] * 1e6:.0f} us; "
              f"adaptive period settled at every {r['adaptive_every']} steps")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
