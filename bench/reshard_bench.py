"""Resume at another world size against a resume at the same size, side by side in one run.

    .venv/bin/python bench/reshard_bench.py                    # 2 -> 3 CPU ranks, 4/16/67 M params

For each model size, one 2-rank DeepSpeed ZeRO-2 job (gloo, CPU, fp32 Adam) trains a step and
saves with `engine.save_checkpoint`; then, timed on fresh engines:
- a 2-rank job loads it with `engine.load_checkpoint` (the reference: same size, no conversion);
- a 3-rank job loads it with `diag.trainer.elastic.reshard.load` (what `FlashCheckpointer.load()` does at
  another size): rank 0 runs DeepSpeed's universal checkpoint converter, then every rank loads
  the universal checkpoint. The conversion's own seconds are reported apart.
Times are wall seconds from a barrier before to a barrier after the load. Prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scratch import private_tmpdir

# million parameters -> (hidden, layers) of a stack of square Linear layers
SHAPES = {4: (1024, 4), 16: (2048, 4), 67: (2048, 16)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="4,16,67", help=f"million parameters, of {sorted(SHAPES)}")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--worker", choices=("save", "load", "reshard"), help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> int:
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from diag.trainer.elastic import reshard

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo")
    hidden, layers = SHAPES[args.size]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers)))
    world = dist.get_world_size()
    config = {
        "train_batch_size": 6,
        "train_micro_batch_size_per_gpu": 6 // world,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    doc: dict = {"world": world}
    if args.worker == "save":
        x = torch.randn(6 // world, hidden)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        engine.save_checkpoint(str(args.ckpt), tag="global_step1")
    else:
        dist.barrier()
        t0 = time.perf_counter()
        if args.worker == "load":
            path, _ = engine.load_checkpoint(str(args.ckpt), tag="global_step1")
            doc["converted_s"] = 0.0
        else:
            result = reshard.load(engine, args.ckpt, "global_step1")
            path = result.path
            doc["converted_s"] = result.verdict.seconds
            doc["resharded"] = result.verdict.resharded
        dist.barrier()
        doc["load_s"] = time.perf_counter() - t0
        doc["ok"] = path is not None and engine.global_steps == 1
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(doc))
    dist.destroy_process_group()
    return 0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(nproc: int, *args: str) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_port()), "--max-restarts", "0",
        __file__, *args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        # A ZeRO rank leaves without finalizing the interpreter (gloo teardown race).
        from diag.trainer import exit_process

        exit_process(worker(args))
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="diag-bench-reshard-", dir=args.dir))
    rows = []
    try:
        for size in sizes:
            ckpt = work / f"m{size}"
            common = ["--size", str(size), "--ckpt", str(ckpt)]
            print(f"{size} M parameters: saving at 2 ranks ...", file=sys.stderr, flush=True)
            _run(2, "--worker", "save", *common, "--result", str(work / "save.json"))
            nbytes = sum(
                p.stat().st_size for p in (ckpt / "global_step1").rglob("*") if p.is_file()
            )
            print("  same-size load at 2 ranks ...", file=sys.stderr, flush=True)
            _run(2, "--worker", "load", *common, "--result", str(work / "load.json"))
            print("  resharded load at 3 ranks ...", file=sys.stderr, flush=True)
            _run(3, "--worker", "reshard", *common, "--result", str(work / "reshard.json"))
            same = json.loads((work / "load.json").read_text())
            other = json.loads((work / "reshard.json").read_text())
            assert same["ok"] and other["ok"] and other["resharded"], (same, other)
            universal = sum(p.stat().st_size for p in (ckpt / ".diag").rglob("*") if p.is_file())
            rows.append((size, nbytes, universal, same, other))
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{dt.date.today()} {platform.node()} {os.cpu_count()} cores; DeepSpeed ZeRO-2 fp32 "
          "Adam, gloo CPU; saved at 2 ranks, loaded at 2 (same size) and at 3 (resharded)\n")  # fmt: skip
    print("| params | checkpoint | universal | same-size load | convert | universal load | "
          "resharded total | ratio | convert GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for size, nbytes, universal, same, other in rows:
        load_only = other["load_s"] - other["converted_s"]
        print(
            f"| {size} M | {nbytes / 1e9:.3f} GB | {universal / 1e9:.3f} GB | {same['load_s']:.2f} s "
            f"| {other['converted_s']:.2f} s | {load_only:.2f} s | {other['load_s']:.2f} s "
            f"| {other['load_s'] / same['load_s']:.1f}x | {nbytes / 1e9 / other['converted_s']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    with private_tmpdir():
        rc = main()
    sys.exit(rc)
