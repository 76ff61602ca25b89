"""The training job of the pod-deletion tests: a small 2-rank DeepSpeed ZeRO-2 model whose data
depends only on the step, with a flash checkpoint in memory after every step, so a run stopped at
any moment and relaunched can be compared bit for bit with an uninterrupted one.

    torchrun --nproc-per-node 2 tests/support/jobs/pod_job.py --steps 400 --save-dir D --out O [--drain]

It resumes with `FlashCheckpointer.load()` (memory, else storage). Each rank appends
"<step> <monotonic time>" to O/progress-r<rank>.txt once a step is complete, its snapshot in
memory included (CLOCK_MONOTONIC is one clock for every process of the machine, so a test can
tell which steps were complete when it sent SIGTERM). Rank 0 appends each step's loss to
O/loss.jsonl, the digest of the parameters it starts from to O/starts.jsonl, and, with
--digest-every-step, each step's parameter digest to O/digests.jsonl. With --drain the ranks
also drain on their own signals (`graceful_exit`); without it SIGTERM kills them mid-step and
only the agent saves anything. --long-step K:S makes step K last S seconds more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle per step")
    p.add_argument("--drain", action="store_true", help="graceful_exit on the ranks' signals")
    p.add_argument("--persist-every", type=int, default=0, help="periodic persists (0: none)")
    p.add_argument("--long-step", default="", help="K:S: step K takes S seconds more")
    p.add_argument("--digest-every-step", action="store_true")
    p.add_argument("--no-flash", action="store_true", help="no flash checkpointer (a reference)")
    return p.parse_args(argv)


def digest(engine) -> str:  # type: ignore[no-untyped-def]
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist
    from dsengine import no_jit_ops, tiny_config, tiny_engine

    import diag.trainer

    no_jit_ops()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    h = args.hidden
    engine = tiny_engine(h, tiny_config(2))
    ckpt = None if args.no_flash else diag.trainer.FlashCheckpointer(engine, args.save_dir)
    if args.drain:
        diag.trainer.graceful_exit(engine, args.save_dir, checkpointer=ckpt)
    start = 0
    if ckpt is not None:
        start = ckpt.load() or 0
    elif (Path(args.save_dir) / "latest").exists():
        engine.load_checkpoint(args.save_dir)
        start = engine.global_steps
    long_step, long_s = (int(x) for x in args.long_step.split(":")) if args.long_step else (0, 0)
    if rank == 0:
        with open(out / "starts.jsonl", "a") as f:
            how = ckpt.stats.loaded_from if ckpt is not None else "storage" if start else ""
            row = {"step": start, "from": how, "digest": digest(engine)}
            f.write(json.dumps(row) + "\n")
    progress = open(out / f"progress-r{rank}.txt", "a", buffering=1)  # noqa: SIM115
    digests = open(out / "digests.jsonl", "a", buffering=1) if rank == 0 else None  # noqa: SIM115
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(args.seed * 1000 + step * 10 + rank)
        x = torch.randn(4, h, generator=gen)
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        if step == long_step:
            time.sleep(long_s)
        engine.step()  # a drain saves and leaves in here
        persist = bool(args.persist_every) and step % args.persist_every == 0
        if ckpt is not None:
            ckpt.save(step, persist=persist)
            ckpt.wait()  # "complete" below means: in memory too
        progress.write(f"{step} {time.monotonic()}\n")
        if rank == 0:
            with open(out / "loss.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            if digests is not None and args.digest_every_step:
                digests.write(json.dumps({"step": step, "digest": digest(engine)}) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from diag.trainer import exit_process

    exit_process(main())
