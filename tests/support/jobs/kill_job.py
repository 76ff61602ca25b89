"""The training job of the kill suite (killsuite.py): one rank of a 2-rank DeepSpeed ZeRO job that
trains without end, saves a flash checkpoint every step and asks the agent to persist each (or every
`--persist-every`th).

    RANK=0 WORLD_SIZE=2 ... python tests/support/jobs/kill_job.py --zero 2 --save-dir D --ctl C --gen 3

It imports everything, then waits for `C/go-<gen>` (the path of a file store in it) before it joins the
process group, so the harness can start the next generation ahead of a kill. It loads the newest
checkpoint, rank 0 writes `C/start-<gen>.json` (the step, where it came from, the load's seconds) and appends each
step's loss to `C/loss-<gen>.jsonl`: the data depend only on the step, so a step trained again
after a restore must give the same loss to the bit. The phases are marked for faults.py. The job
leaves cleanly when `C/stop` appears.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--job", default="kill")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--ctl", required=True)
    p.add_argument("--gen", type=int, required=True)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--pause", type=float, default=0.05, help="seconds of idle time per step")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--persist-every", type=int, default=1,
        help="ask the agent to persist every Nth step to storage (every step stays in memory)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ctl = Path(args.ctl)
    import torch
    import torch.distributed as dist
    from dsengine import no_jit_ops, tiny_config, tiny_engine
    from faults import Injector, install_trainer, write_json_atomic

    import diag.trainer

    install_trainer(Injector(ctl, f"rank{os.environ['RANK']}"))
    no_jit_ops()
    go = ctl / f"go-{args.gen}"
    while not go.exists():
        if (ctl / "stop").exists():
            return 0
        time.sleep(0.01)
    # A file store: no port to collide with the other jobs of the machine.
    store = go.read_text().strip()
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )  # fmt: skip
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    h = args.hidden
    engine = tiny_engine(h, tiny_config(args.zero, lr=1e-3), widen=4)
    ckpt = diag.trainer.FlashCheckpointer(engine, args.save_dir, job=args.job)
    loading_at, t0 = time.time(), time.monotonic()
    start = ckpt.load() or 0
    load_s = time.monotonic() - t0  # the state's read alone: the engine is built by now
    if rank == 0:
        doc = {"step": start, "from": ckpt.stats.loaded_from, "at": time.time(), "load_s": load_s,
               "loading_at": loading_at}  # fmt: skip
        write_json_atomic(ctl / f"start-{args.gen}.json", json.dumps(doc))
    losses = open(ctl / f"loss-{args.gen}.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    step = start
    stop = ctl / "stop"
    while True:
        flag = torch.tensor([float(stop.exists())])
        dist.all_reduce(flag)  # every rank leaves at the same step
        if flag.item():
            break
        step += 1
        gen = torch.Generator().manual_seed(args.seed * 100003 + step * 10 + rank)
        x = torch.randn(4, h, generator=gen)
        loss = (engine(x) - x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if losses is not None:
            losses.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            losses.flush()
        ckpt.save(step, {"data_step": step}, persist=step % args.persist_every == 0)
        time.sleep(args.pause)
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from diag.trainer import exit_process

    exit_process(main())
