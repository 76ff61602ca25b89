"""The training job of the drain tests: a small DeepSpeed model whose data depends only on the
step, drained by `diag.trainer.graceful_exit` (signals, stop file), so a run stopped at any moment
and relaunched can be compared bit for bit with an uninterrupted one.

    torchrun --nproc-per-node 2 tests/support/jobs/drain_job.py --steps 40 --save-dir D --out O

It resumes from D with `engine.load_checkpoint` when D holds a checkpoint. Each rank appends
"<step> <monotonic time>" to O/progress-r<rank>.txt as each step completes (CLOCK_MONOTONIC is
the same clock in every process of the machine, so a test can tell which steps were complete
when it sent a signal); rank 0 appends each step's loss to O/loss.jsonl, writes where each
attempt started to O/starts.jsonl and, after the last step, the parameters to
O/params.pt. Without --no-drain the ranks save and leave with the drain exit code when asked.
Each rank writes its pid to O/pid-r<rank>. --linger-at-exit makes a rank's exit slow, as tearing
down a large job is: `before` sleeps 120 s in an exit handler that runs after graceful_exit's,
`after` waits (up to 120 s) for a stop request in one that runs before it; both first create
O/leaving-r<rank>.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import time
from collections.abc import Callable
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle per step")
    p.add_argument("--flash", action="store_true", help="with a flash checkpointer too")
    p.add_argument("--no-drain", action="store_true")
    p.add_argument("--stop-file", default=None)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--max-latency", type=float, default=None)
    p.add_argument("--linger-at-exit", choices=("before", "after"), default=None)
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist
    from dsengine import no_jit_ops, tiny_config, tiny_engine

    import diag.trainer

    no_jit_ops()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    h = args.hidden
    engine = tiny_engine(h, tiny_config(args.zero))
    (out / f"pid-r{rank}").write_text(str(os.getpid()))
    ckpt = diag.trainer.FlashCheckpointer(engine, args.save_dir) if args.flash else None
    if args.linger_at_exit == "before":
        atexit.register(_linger, out / f"leaving-r{rank}", None)  # runs after graceful_exit's
    if not args.no_drain:
        diag.trainer.graceful_exit(
            engine, args.save_dir, checkpointer=ckpt, stop_file=args.stop_file,
            every=args.every, max_latency_s=args.max_latency,
        )  # fmt: skip
    if args.linger_at_exit == "after":
        from diag.trainer.graceful.stopflag import stop_flag

        atexit.register(_linger, out / f"leaving-r{rank}", stop_flag().is_set)
    start = 0
    if (Path(args.save_dir) / "latest").exists():
        path, _ = engine.load_checkpoint(args.save_dir)
        assert path is not None, "the checkpoint named by latest did not load"
        start = engine.global_steps
    if rank == 0:
        with open(out / "starts.jsonl", "a") as f:
            f.write(json.dumps({"step": start, "attempt": attempt, "pid": os.getpid()}) + "\n")
    progress = open(out / f"progress-r{rank}.txt", "a", buffering=1)  # noqa: SIM115
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(args.seed * 1000 + step * 10 + rank)
        x = torch.randn(4, h, generator=gen)
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        engine.step()  # a drain saves and leaves in here
        progress.write(f"{step} {time.monotonic()}\n")
        if rank == 0:
            with open(out / "loss.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if rank == 0:
        torch.save(params, out / "params.pt")
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()
    return 0


def _linger(marker: Path, until: Callable[[], bool] | None) -> None:
    marker.touch()
    end = time.monotonic() + 120
    while time.monotonic() < end and not (until is not None and until()):
        time.sleep(0.05)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from diag.trainer import exit_process

    exit_process(main())
