"""A job that hangs early: a 2-rank DeepSpeed ZeRO-2 CPU job, attached to its op journal, saving a
flash checkpoint every step, in which one rank stops (sleeps) soon after the start of an attempt.

    torchrun --max-restarts 2 ... tests/support/jobs/early_hang_job.py --save-dir D --out O \
        --hang-step 25 --hang-attempts 0 [--step-time 0.17] [--pg-timeout 60]

--hang-where save: the rank stops after engine.step(), before the flash save (whose agreement
the others then wait in). --hang-attempts: the attempts (TORCHELASTIC_RESTART_COUNT) in which --hang-rank sleeps at
--hang-step (counted from the step it resumed at); the agent stops the ranks and torchrun restarts
them, resuming from the flash checkpoint. Each rank appends {"attempt", "rank", "step", "t"} (t on
the monotonic clock) to O/steps.jsonl after each step, and {"attempt", "rank", "restored", "t"}
once it is restored, so the test can tell the cost of the fault.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.17, help="seconds per step, at least")
    p.add_argument("--hang-step", type=int, default=25)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--hang-attempts", default="0", help="comma-separated restart counts")
    p.add_argument(
        "--hang-where",
        choices=("step", "save"),
        default="step",
        help="sleep before the step's forward, or between engine.step() and the flash save",
    )
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--job", default="early-hang")
    return p.parse_args(argv)


def _note(out: Path, **row: object) -> None:
    with open(out / "steps.jsonl", "a") as f:
        f.write(json.dumps({**row, "t": time.monotonic()}) + "\n")


def _stop(out: Path, attempt: int, rank: int, step: int) -> None:
    _note(out, attempt=attempt, rank=rank, hang=step)
    time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist
    from dsengine import no_jit_ops, tiny_config, tiny_engine

    import diag.trainer

    no_jit_ops()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hang_attempts = {int(a) for a in args.hang_attempts.split(",") if a}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(7)
    engine = tiny_engine(32, tiny_config(2))
    diag.trainer.attach(engine, job=args.job)
    ckpt = diag.trainer.FlashCheckpointer(engine, args.save_dir, job=args.job)
    start = ckpt.load() or 0
    _note(out, attempt=attempt, rank=rank, restored=start)
    for step in range(start + 1, args.steps + 1):
        t0 = time.monotonic()
        hang = (
            attempt in hang_attempts and rank == args.hang_rank and step - start == args.hang_step
        )
        if hang and args.hang_where == "step":
            _stop(out, attempt, rank, step)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if hang and args.hang_where == "save":
            _stop(out, attempt, rank, step)
        ckpt.save(step)
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
        _note(out, attempt=attempt, rank=rank, step=step)
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
