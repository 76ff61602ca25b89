"""The training job of the elastic tests: a small DeepSpeed model trained with an elastic config,
so that its global batch is the same at every allowed world size, and data that depends only on
the step, so a run resumed at another size can be compared with an uninterrupted one.

    torchrun --nproc-per-node 4 tests/support/jobs/elastic_job.py --zero 1,2,3 --steps 3 --save-dir D --out O

Each step trains on the same global batch of ELASTIC["max_train_batch_size"] samples whatever the
world size: rank r takes micro batches j*world+r of it (the micro batch size and gradient
accumulation come from diag.trainer.elastic.batchsize). Stages run one after the other in the same
processes, each with its own job name (<prefix>-z<stage>), checkpoint directory D/z<stage> and
output directory O/z<stage>. With the flash checkpointer (the default) it resumes through
`FlashCheckpointer.load()` and asks the agent to persist the last step (and every Nth with
--persist-every N). Rank 0 writes the plan
(plan.json), where it started (start.json) and each step's loss, averaged over the global batch
(loss.jsonl).

With --drain (one stage) it runs without a checkpointer or an agent: `graceful_exit` saves to
storage with `engine.save_checkpoint` when told to go (signals, --stop-file) and leaves, and a
relaunch resumes from storage through `diag.trainer.elastic.reshard.load` at whatever size it has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ELASTIC = {
    "enabled": True,
    "max_train_batch_size": 12,
    "micro_batch_sizes": [2, 3],
    "min_gpus": 1,
    "max_gpus": 8,
    "version": 0.1,
}  # global batch 12; valid world sizes 1, 2, 3, 4, 6
HIDDEN = 16


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", default="2", help="ZeRO stages, comma-separated")
    p.add_argument("--job-prefix", default="elastic")
    p.add_argument("--steps", type=int, default=6, help="train up to this step")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--no-flash", action="store_true", help="train without a checkpointer")
    p.add_argument("--drain", action="store_true", help="no checkpointer: drain to storage")
    p.add_argument("--stop-file", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle per step")
    p.add_argument(
        "--hidden", type=int, default=HIDDEN,
        help="the model's width (a larger snapshot: 512 makes a push of about 12 MB per rank)",
    )  # fmt: skip
    p.add_argument(
        "--persist-every", type=int, default=0,
        help="also ask the agent to persist every Nth step (0: the last step only)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch.distributed as dist
    from dsengine import no_jit_ops

    from diag.trainer.graceful.teardown import quiesce_at_exit

    no_jit_ops()
    # Its runs without a checkpointer or a drain (the uninterrupted baselines) use nothing of
    # diag that would register this, and would then abort at exit now and then (docs: operator/troubleshooting.md).
    quiesce_at_exit()
    dist.init_process_group("gloo")
    for zero in (int(z) for z in args.zero.split(",")):
        run_stage(args, zero)
    dist.destroy_process_group()
    return 0


def run_stage(args: argparse.Namespace, zero: int) -> None:
    import torch
    import torch.distributed as dist

    import diag.trainer
    from diag.trainer.elastic.batchsize import apply_elastic

    rank, world = dist.get_rank(), dist.get_world_size()
    job = f"{args.job_prefix}-z{zero}"
    save_dir = Path(args.save_dir) / f"z{zero}"
    out = Path(args.out) / f"z{zero}"
    out.mkdir(parents=True, exist_ok=True)
    from dsengine import tiny_config, tiny_engine

    base = tiny_config(zero, elasticity=ELASTIC)
    # The batch sizes are elasticity's to choose.
    del base["train_micro_batch_size_per_gpu"], base["gradient_accumulation_steps"]
    config, plan = apply_elastic(base)
    assert plan is not None
    torch.manual_seed(args.seed)
    engine = tiny_engine(args.hidden, config)
    no_flash = args.no_flash or args.drain
    ckpt = None if no_flash else diag.trainer.FlashCheckpointer(engine, save_dir, job=job)
    start = (ckpt.load() or 0) if ckpt is not None else 0
    resharded_from = None
    if args.drain:
        from diag.formats.snapshot import read_latest_step, step_tag
        from diag.trainer.elastic import reshard

        diag.trainer.graceful_exit(engine, save_dir, stop_file=args.stop_file)
        latest = read_latest_step(save_dir)
        if latest is not None:
            result = reshard.load(engine, save_dir, step_tag(latest))
            start = latest
            if result.verdict.resharded:
                resharded_from = result.verdict.saved_dp
    if rank == 0:
        (out / "plan.json").write_text(
            json.dumps(
                {
                    "world_size": world,
                    "train_batch_size": engine.train_batch_size(),
                    "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                    "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                    "valid_world_sizes": list(plan.valid_world_sizes),
                }
            )
        )
        stats = ckpt.stats if ckpt is not None else None
        (out / "start.json").write_text(
            json.dumps(
                {
                    "step": start,
                    "global_steps": engine.global_steps,
                    "from": stats.loaded_from if stats else "storage" if start else "",
                    "resharded_from": stats.resharded_from if stats else resharded_from,
                }
            )
        )
    mb, gas = plan.micro_batch_size, plan.gradient_accumulation_steps
    for step in range(start + 1, args.steps + 1):
        batch = torch.randn(
            plan.train_batch_size, args.hidden, generator=torch.Generator().manual_seed(step)
        )
        total = torch.zeros(())
        for j in range(gas):
            first = (j * world + rank) * mb
            x = batch[first : first + mb]
            loss = (engine(x) - x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        assert engine.global_steps == step, (engine.global_steps, step)
        dist.all_reduce(total)  # every rank's share is equal: the mean is the global batch's
        if rank == 0:
            with open(out / "loss.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": (total / world).item(), "world": world}))
                f.write("\n")
        if ckpt is not None:
            every = args.persist_every
            persist = step == args.steps or (every > 0 and step % every == 0)
            ckpt.save(step, {"data_step": step}, persist=persist)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if ckpt is not None:
        ckpt.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
