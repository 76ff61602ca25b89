"""Per-step cost of the stop-flag agreement of `diag.trainer.graceful_exit`, against the same job
without it, side by side in one run.

    .venv/bin/python bench/stop_flag_bench.py                # 2 ranks, three model sizes

One torchrun job per model size: a DeepSpeed ZeRO-2 engine (gloo, CPU, fp32 Adam) with
`graceful_exit` hooked on it, trained in blocks of steps that rotate between three modes:
- `off`: the hook is there but never agrees (the reference: the job without the agreement);
- `every step`: an agreement at every step boundary (what ms-swift's graceful exit does);
- `adaptive`: the default period (diag.trainer.control.period: as often as a 1% cost budget allows,
  at most 10 s between agreements).
Every rank times each block between two barriers, in wall time (the slowest rank's counts) and
in CPU time of the process (all its threads, summed over ranks). The ratio of a mode to `off` is
taken within each rotation (blocks next to each other in time, so a machine shared with other
work drifts less between them), and the median over rotations is reported. Also measured in the
same job: the agreement alone (the five-number all-reduce, many times in a row), the `c` of the
scaling arithmetic in BENCHMARKS.md. Prints a table.
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

from scratch import private_tmpdir

SIZES = {"tiny": 32, "small": 256, "medium": 1024}  # hidden width of a 2-layer MLP
MODES = ("off", "every step", "adaptive")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small,medium", help=f"of {sorted(SIZES)}")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--blocks", type=int, default=24, help="rotations (blocks per mode)")
    p.add_argument("--block-steps", type=int, default=0, help="0: 20, and 5 for medium")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> int:
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from diag.trainer.control.commands import Agreement, agree
    from diag.trainer.control.period import AgreementPeriod, PeriodPolicy
    from diag.trainer.graceful.gracefulexit import GracefulExit

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

        block = args.block_steps or (5 if args.size == "medium" else 20)
        # Wall time spent inside the hook itself (the vote, the all-reduce, the bookkeeping):
        # the agreement's cost measured directly, unlike the block ratios not blurred by the
        # machine's other work.
        inside = [0.0]
        hook = drain.at_boundary

        def timed_hook() -> None:
            t = time.perf_counter()
            hook()
            inside[0] += time.perf_counter() - t

        drain.at_boundary = timed_hook  # type: ignore[method-assign]
        run(10)  # warm-up
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        agreements = {m: 0 for m in MODES}
        share: dict[str, list[float]] = {m: [] for m in MODES}
        left = {m: 0 for m in MODES}  # the global step at which each mode's last block ended
        for b in range(args.blocks):
            for i in range(len(MODES)):
                mode = MODES[(b + i) % len(MODES)]  # rotate the order: no mode always first
                drain.enabled = mode != "off"
                if mode != "off":
                    # Resume the period where it left off, as if the other modes' blocks had not
                    # happened (else every block would begin with an overdue agreement).
                    gs = int(engine.global_steps)
                    period = drain.period = periods[mode]
                    if period.next_at is not None:
                        period.next_at += gs - left[mode]
                    drain._boundary = gs
                before = drain.period.agreements
                dist.barrier()
                inside[0] = 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                run(block)
                share[mode].append(inside[0] / (time.perf_counter() - t0))
                t = torch.tensor([time.perf_counter() - t0])
                c = torch.tensor([time.process_time() - c0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                dist.all_reduce(c)
                wall[mode].append(t.item() / block)
                cpu[mode].append(c.item() / block)
                if mode != "off":
                    agreements[mode] += drain.period.agreements - before
                    left[mode] = int(engine.global_steps)
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
        steps = args.blocks * block

        def paired(v: dict[str, list[float]]) -> dict[str, float]:
            return {m: statistics.median(a / b for a, b in zip(v[m], v["off"], strict=True))
                    for m in MODES}  # fmt: skip

        args.result.write_text(
            json.dumps(
                {
                    "step_s": {m: statistics.median(v) for m, v in wall.items()},
                    "cpu_s": {m: statistics.median(v) for m, v in cpu.items()},
                    "wall_ratio": paired(wall),
                    "hook_share": {m: statistics.mean(v) for m, v in share.items()},
                    "cpu_ratio": paired(cpu),
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
          f"gloo; {args.blocks} rotations; per-step medians; ratios: median over rotations "
          "of mode / off")  # fmt: skip
    print("| model | mode | step ms (wall) | wall ratio | CPU ms per step (all ranks) | "
          "CPU ratio | agreements per 100 steps | time in the hook |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for size, r in rows:
        for mode in MODES:
            print(f"| {size} (hidden {SIZES[size]}) | {mode} | {r['step_s'][mode] * 1e3:.2f} | "
                  f"{r['wall_ratio'][mode]:.4f} | {r['cpu_s'][mode] * 1e3:.2f} | "
                  f"{r['cpu_ratio'][mode]:.4f} | {r['agreements_per_100'][mode]:.1f} | "
                  f"{r['hook_share'][mode]:.2%} |")  # fmt: skip
    for size, r in rows:
        print(f"{size}: one agreement alone {r['agree_alone_s'] * 1e6:.0f} us; "
              f"adaptive period settled at every {r['adaptive_every']} steps")  # fmt: skip
    return 0


if __name__ == "__main__":
    with private_tmpdir():
        rc = main()
    sys.exit(rc)
