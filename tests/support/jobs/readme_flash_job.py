"""The flash-checkpoint example of the README's quick start and the docs' Flash checkpoints page as
a job, line for line (without `attach`), on a small DeepSpeed ZeRO-2 model with gloo on CPU:

    torchrun --nproc-per-node 2 tests/support/jobs/readme_flash_job.py SAVE_DIR --steps 14 --kill-step 12

The save pattern is the documented one with a persist every 10 steps (`persist=step % 10 == 0`).
--kill-step K: rank --kill-rank SIGKILLs itself in step K, after `engine.step()` (its memory then
holds steps K-1 and, pinned by its persist, 10). --stock-load TAG:
instead of training, load TAG from SAVE_DIR with DeepSpeed's own `load_checkpoint` and write what
was loaded to SAVE_DIR/../loaded-rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import deepspeed
import deepspeed.ops
import torch

import diag.trainer

HIDDEN = 32


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 2 * HIDDEN),
            torch.nn.GELU(),
            torch.nn.Linear(2 * HIDDEN, HIDDEN),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.net(x) - x).pow(2).mean()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 10 + int(os.environ["RANK"]))
    return torch.randn(4, HIDDEN, generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("save_dir")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--stock-load", default="")
    args = p.parse_args()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build in tests
    torch.manual_seed(7)
    model = Model()
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    rank = int(os.environ["RANK"])
    total_steps = args.steps

    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    if args.stock_load:
        path, _ = engine.load_checkpoint(args.save_dir, tag=args.stock_load)
        out = Path(args.save_dir).parent / f"loaded-rank{rank}.json"
        out.write_text(json.dumps({"path": path, "global_steps": engine.global_steps}))
        return

    # -- the documented example -----------------------------------------------------------------
    ckpt = diag.trainer.FlashCheckpointer(engine, args.save_dir)  # on every rank
    start = ckpt.load() or 0  # newest step every rank holds in memory, else from storage
    for step in range(start + 1, total_steps + 1):
        loss = engine(batch(step))
        engine.backward(loss)
        engine.step()
        if step == args.kill_step and rank == args.kill_rank:  # the fault, not the example's
            os.kill(os.getpid(), signal.SIGKILL)
        # Memory every step; every 10 steps the agent also writes it to save_dir.
        ckpt.save(step, persist=step % 10 == 0)


if __name__ == "__main__":
    main()
