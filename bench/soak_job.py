"""The soak's training job: a small DeepSpeed ZeRO model on CPU (gloo), attached to diag, healthy
but irregular in every way a real job is. One process per rank under torchrun:

    torchrun --nproc-per-node 3 bench/soak_job.py --seconds 300 --straggler-rank 1 ...

What makes it irregular (all seeded, so a run can be repeated):
  --first-step-delay   rank 0 spends this long before its first step (compilation, a cold cache)
  --straggler-rank     this rank sleeps --straggle seconds (+-50 %) every step: slow, progressing
  --stall-prob/-max    each rank, independently, stalls in its data loader with this probability
                       per step for up to --stall-max seconds (outside any declared phase)
  --eval-every/-seconds  rank 0 evaluates (a declared "eval" phase) every N steps for about that
                       long while the others wait at a barrier
  --flash-every        flash-checkpoint every N steps; every --persist-every-th one is persisted
                       by the agent
  --save-every         a plain DeepSpeed checkpoint (engine.save_checkpoint) every N steps
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, required=True, help="train for about this long")
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--first-step-delay", type=float, default=0.0)
    p.add_argument("--straggler-rank", type=int, default=-1)
    p.add_argument("--straggle", type=float, default=0.3)
    p.add_argument("--stall-prob", type=float, default=0.0)
    p.add_argument("--stall-max", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-seconds", type=float, default=0.0)
    p.add_argument("--flash-every", type=int, default=0)
    p.add_argument("--persist-every", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--save-dir", default="")
    p.add_argument("--step-sleep", type=float, default=0.05, help="compute stand-in per step")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build
    import diag.trainer

    timeout = dt.timedelta(seconds=900)
    c10d.default_pg_timeout = timeout
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    rng = random.Random(args.seed * 1000 + rank)
    torch.manual_seed(args.seed)
    h = args.hidden
    model = torch.nn.Sequential(
        torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
    )
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    diag.trainer.attach(engine)
    ckpt = None
    if args.flash_every:
        ckpt = diag.trainer.FlashCheckpointer(engine, os.path.join(args.save_dir, "flash"))
    gen = torch.Generator().manual_seed(args.seed + rank)
    t0 = time.monotonic()
    step = 0
    flashes = 0
    while True:
        # Every rank must agree on when to stop: rank 0 decides, the others follow.
        done = torch.tensor([1.0 if time.monotonic() - t0 >= args.seconds else 0.0])
        dist.broadcast(done, 0)
        if done.item():
            break
        if step == 0 and rank == 0 and args.first_step_delay:
            time.sleep(args.first_step_delay)
        if args.stall_prob and rng.random() < args.stall_prob:
            stall = rng.uniform(0.2, args.stall_max)
            print(f"soak_job rank {rank}: data-loader stall {stall:.1f} s", flush=True)
            time.sleep(stall)
        if rank == args.straggler_rank:
            if step == 0:
                print(f"soak_job rank {rank}: straggling from {time.time():.3f}", flush=True)
            time.sleep(args.straggle * rng.uniform(0.5, 1.5))
        time.sleep(args.step_sleep)
        x = torch.randn(args.batch, h, generator=gen)
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        step += 1
        if ckpt is not None and step % args.flash_every == 0:
            flashes += 1
            persist = bool(args.persist_every) and flashes % args.persist_every == 0
            ckpt.save(step, persist=persist)
        if args.save_every and step % args.save_every == 0:
            engine.save_checkpoint(os.path.join(args.save_dir, "ds"), tag=f"s{step}")
        if args.eval_every and step % args.eval_every == 0:
            if rank == 0:
                seconds = args.eval_seconds * rng.uniform(0.7, 1.3)
                print(f"soak_job rank 0: eval {seconds:.1f} s", flush=True)
                with diag.trainer.phase("eval"):
                    time.sleep(seconds)
            dist.barrier()
        if rank == 0 and step % 50 == 0:
            print(f"soak_job: step {step} at {time.monotonic() - t0:.0f} s", flush=True)
    if rank == 0:
        print(f"soak_job: done, {step} steps in {time.monotonic() - t0:.1f} s", flush=True)
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from diag.trainer.graceful.teardown import exit_process

    exit_process(main())
