"""A tiny journaled job for benchmarks: every rank issues gloo collectives in steps, nothing else.

    torchrun --nproc-per-node 8 bench/collective_ranks.py --seconds 120 --steps-per-second 5

Each step: `--ops` collectives (allreduce mostly, one allgather and one broadcast), then a step
boundary; the rank sleeps away the rest of the step's time slot.
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--steps-per-second", type=float, default=5.0)
    p.add_argument("--ops", type=int, default=10, help="collectives per step")
    p.add_argument("--numel", type=int, default=16384, help="float32 elements per tensor")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    import diag.trainer

    dist.init_process_group("gloo")
    diag.trainer.attach()
    world = dist.get_world_size()
    x = torch.ones(args.numel)
    gathered = [torch.empty(args.numel) for _ in range(world)]
    slot = 1.0 / args.steps_per_second
    end = time.monotonic() + args.seconds
    go = torch.ones(1)
    step = 0
    while go.item() > 0:
        t0 = time.monotonic()
        for _ in range(args.ops - 2):
            dist.all_reduce(x)
            x.fill_(1.0)
        dist.all_gather(gathered, x)
        # Rank 0 decides when to stop, so every rank runs the same number of collectives.
        go.fill_(1.0 if time.monotonic() < end else 0.0)
        dist.broadcast(go, src=0)
        step += 1
        diag.trainer.step(step)
        time.sleep(max(0.0, slot - (time.monotonic() - t0)))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
