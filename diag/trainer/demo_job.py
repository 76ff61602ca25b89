"""The demo's training job: a small DeepSpeed ZeRO model on CPU (gloo), attached to diag, with an
optional injected fault. Run one process per rank under torchrun:

    torchrun --nproc-per-node 4 -m diag.trainer.demo_job --fault hang --fault-rank 2

Faults, injected on `--fault-rank` at `--fault-step`:
  hang       the rank sleeps before its next collective; the others wait for it forever
  exit       the rank is killed (SIGKILL, like the OOM killer)
  gil        the rank spins inside C code holding the GIL (a catastrophic regex)
  straggler  the rank sleeps `--straggle` seconds every step: slow, but it progresses
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import signal
import time

FAULTS = ("none", "hang", "exit", "gil", "straggler")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diag.trainer.demo_job", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=6)
    p.add_argument("--straggle", type=float, default=0.3, help="extra seconds per step")
    p.add_argument("--eval-every", type=int, default=0, help="rank 0 evaluates every N steps")
    p.add_argument("--eval-seconds", type=float, default=0.0)
    p.add_argument("--first-step-delay", type=float, default=0.0, help="rank 0 is slow in step 0")
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=600.0,
        help="collective timeout of every process group, seconds",
    )
    p.add_argument("--no-attach", action="store_true", help="run without diag (for benchmarks)")
    p.add_argument("--seed", type=int, default=1234)
    # The deepspeed launcher passes this; the rank comes from the environment either way.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--flash-every", type=int, default=0, help="flash-checkpoint every N steps (0: never)"
    )
    p.add_argument("--save-dir", default="", help="where the agent persists flash checkpoints")
    return p.parse_args(argv)


def inject(fault: str, straggle: float) -> None:
    if fault != "straggler":
        # Wall-clock time of the fault, for the detection-latency benchmark.
        print(f"diag-demo: injecting {fault} at {time.time():.3f}", flush=True)
    if fault == "hang":
        time.sleep(10**6)
    elif fault == "exit":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "gil":
        # The regex engine runs in C and never releases the GIL: nothing else in this process
        # (our journal callbacks included) runs again.
        re.match(r"(a+)+$", "a" * 64 + "!")
    elif fault == "straggler":
        time.sleep(straggle)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    # DeepSpeed's CPU accelerator would JIT-build a shared-memory allreduce (~30 s) used only for
    # inference; training goes through torch.distributed either way.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import diag.trainer

    timeout = dt.timedelta(seconds=args.pg_timeout)
    # Groups made later (DeepSpeed's data-parallel group among them) take torch's module default
    # (30 min for gloo, 10 min for NCCL), not the timeout given here: set that default too, so
    # --pg-timeout is the collective timeout of every group.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
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
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    if not args.no_attach:
        diag.trainer.attach(engine)
    ckpt = None
    if args.flash_every:
        ckpt = diag.trainer.FlashCheckpointer(engine, args.save_dir or "checkpoints")
        ckpt.load()
    gen = torch.Generator().manual_seed(args.seed + rank)
    faulty = args.fault != "none" and rank == args.fault_rank
    t0 = time.monotonic()
    for step in range(args.steps):
        if step == 0 and args.first_step_delay and rank == 0:
            time.sleep(args.first_step_delay)
        if faulty and (step == args.fault_step or (args.fault == "straggler" and step > 0)):
            inject(args.fault, args.straggle)
        x = torch.randn(args.batch, h, generator=gen)
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if ckpt is not None and (step + 1) % args.flash_every == 0:
            # Memory only: the agent persists the newest snapshot if a rank dies or hangs.
            ckpt.save(step + 1)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            # Only rank 0 evaluates; the others wait for it at the barrier, outside any phase.
            if rank == 0:
                with diag.trainer.phase("eval"):
                    time.sleep(args.eval_seconds)
            dist.barrier()
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"done: {args.steps} steps in {time.monotonic() - t0:.1f} s", flush=True)
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from diag.trainer.graceful.teardown import exit_process

    # Not sys.exit: see diag.trainer.graceful.teardown (a gloo teardown race aborts ZeRO-3 ranks).
    exit_process(main())
