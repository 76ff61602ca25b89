"""The training job of the flash-checkpoint tests: a small DeepSpeed model whose data depends only
on the step, so a resumed run can be compared bit for bit with an uninterrupted one.

    torchrun --nproc-per-node 2 tests/support/jobs/flash_job.py --zero 1,2,3 --steps 8 --save-dir D --out O

Stages (ZeRO 1, 2, 3) run one after the other in the same processes, each with its own job name
(<prefix>-z<stage>), checkpoint directory D/z<stage> and output directory O/z<stage>. Every step
it saves a flash checkpoint (memory); with --persist-every it also asks the agent to persist.
--kill-step K kills --kill-rank with SIGKILL, right after its save of step K (--kill-mode
after-save) or in the middle of the memory copy of step K (--kill-mode mid-copy). It calls load()
first, so a relaunch resumes. Rank 0 appends each step's loss to O/z<stage>/loss.jsonl and writes
the final parameters to O/z<stage>/params.pt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", default="2", help="ZeRO stages, comma-separated")
    p.add_argument("--job-prefix", default="flash")
    p.add_argument("--bf16", action="store_true", help="bf16 in every stage")
    p.add_argument("--bf16-stages", default="", help="bf16 in these stages, comma-separated")
    p.add_argument("--fp16", action="store_true", help="GPU only (DeepSpeed has no CPU fp16)")
    p.add_argument("--cuda", action="store_true", help="NCCL and CUDA tensors")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--no-flash", action="store_true", help="train without the checkpointer")
    p.add_argument("--persist-every", type=int, default=0)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-mode", choices=("after-save", "mid-copy"), default="after-save")
    p.add_argument("--stock-load", action="store_true", help="resume with engine.load_checkpoint")
    p.add_argument("--wait-commands", type=float, default=0.0, help="seconds per step to idle")
    p.add_argument("--attach", action="store_true", help="also attach the op journal")
    p.add_argument("--no-control", action="store_true", help="no control channel")
    p.add_argument("--stats", action="store_true", help="write each rank's FlashStats at the end")
    return p.parse_args(argv)


def kill_mid_copy() -> None:
    """Makes the next flash save die with SIGKILL after half of its storages are copied."""
    from diag.trainer.flash import slotlayout as layout

    original = layout.copy_storage
    copied = [0]

    def copy_then_die(dst, storage, nbytes):  # type: ignore[no-untyped-def]
        original(dst, storage, nbytes)
        copied[0] += 1
        if copied[0] >= 2:
            os.kill(os.getpid(), signal.SIGKILL)

    layout.copy_storage = copy_then_die


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch.distributed as dist
    from dsengine import no_jit_ops

    no_jit_ops()
    if args.cuda:
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.cuda else "gloo")
    for zero in (int(z) for z in args.zero.split(",")):
        run_stage(args, zero)
    dist.destroy_process_group()
    return 0


def run_stage(args: argparse.Namespace, zero: int) -> None:
    import torch
    import torch.distributed as dist

    import diag.trainer

    rank = dist.get_rank()
    job = f"{args.job_prefix}-z{zero}"
    save_dir = Path(args.save_dir) / f"z{zero}"
    out = Path(args.out) / f"z{zero}"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    h = args.hidden
    from dsengine import tiny_config, tiny_engine

    config = tiny_config(zero)
    bf16 = args.bf16 or str(zero) in args.bf16_stages.split(",")
    if bf16:
        config["bf16"] = {"enabled": True}
    if args.fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine = tiny_engine(h, config)
    if args.attach:
        diag.trainer.attach(engine, job=job)
    ckpt = None
    if not args.no_flash:
        ckpt = diag.trainer.FlashCheckpointer(
            engine, save_dir, job=job, control=not args.no_control
        )
    start = 0
    if args.stock_load:
        path, _ = engine.load_checkpoint(str(save_dir))
        start = engine.global_steps if path is not None else 0
    elif ckpt is not None:
        start = ckpt.load() or 0
    if rank == 0:
        how = ckpt.stats.loaded_from if ckpt is not None else ""
        (out / "start.json").write_text(json.dumps({"step": start, "from": how}))
    dtype = torch.bfloat16 if bf16 else torch.float16 if args.fp16 else torch.float32
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(args.seed * 1000 + step * 10 + rank)
        x = torch.randn(4, h, generator=gen).to(device=engine.device, dtype=dtype)
        loss = (engine(x) - x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if rank == 0:
            with open(out / "loss.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
        kill_now = step == args.kill_step and rank == args.kill_rank
        if kill_now and args.kill_mode == "mid-copy":
            kill_mid_copy()
        if ckpt is not None:
            persist = bool(args.persist_every) and step % args.persist_every == 0
            ckpt.save(step, {"data_step": step}, persist=persist)
        if kill_now:
            if ckpt is not None:
                ckpt.wait()  # "after the save": its copy into shared memory is complete
            os.kill(os.getpid(), signal.SIGKILL)
        if args.wait_commands:
            time.sleep(args.wait_commands)
    params = _gathered_params(engine, zero)
    if rank == 0:
        torch.save({k: v.cpu() for k, v in params.items()}, out / "params.pt")
    if ckpt is not None and args.stats:
        (out / f"stats-{rank}.json").write_text(json.dumps(dataclasses.asdict(ckpt.stats)))
    if ckpt is not None:
        ckpt.close()


def _gathered_params(engine, zero: int) -> dict:  # type: ignore[no-untyped-def]
    import deepspeed

    params = list(engine.module.named_parameters())
    if zero == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


if __name__ == "__main__":
    from diag.trainer import exit_process

    exit_process(main())
