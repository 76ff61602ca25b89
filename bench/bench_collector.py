"""Collector overhead, measured side by side in one run.

1. Journal cost: one op record appended and completed (what every instrumented op pays), in a
   single process.
2. Per-op host cost: 2 gloo ranks issue tiny all_reduces in alternating blocks, with the
   instrumentation installed and removed, in the same processes.
3. Step time of a 2-rank DeepSpeed ZeRO-2 CPU job, alternating blocks of steps with and without
   `attach`, in the same processes.

    python bench/bench_collector.py [--blocks 6]
    python bench/bench_collector.py --gpu [--json out.json]

With --gpu the ranks use NCCL on CUDA (one per GPU, at most 2), the collectives are timed by the
CUDA-event path, and the model is a bf16 ZeRO-2 MLP sized for a real device (4096 tokens of
width --hidden through --layers blocks), its steps timed after a device synchronize.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scratch import private_tmpdir


def journal_cost(n: int = 200_000) -> float:
    from diag.formats.journalwriter import JournalWriter
    from diag.formats.records import OpCode, OpState, RecordKind

    with tempfile.TemporaryDirectory() as d:
        w = JournalWriter(Path(d) / "bench.journal", rank=0, world_size=1, local_rank=0)
        t0 = time.perf_counter()
        for i in range(n):
            seq = w.append(
                RecordKind.OP,
                state=OpState.ENQUEUED,
                op=OpCode.ALL_REDUCE,
                group=0,
                group_seq=i,
                nbytes=4,
                t_enqueue_ns=i,
                live=True,
            )
            w.update(seq, OpState.COMPLETED, t_end_ns=i + 1)
        return (time.perf_counter() - t0) / n * 1e6


def wrapper_cost(n: int = 100_000) -> float:
    """Host cost of one instrumented op as the trainer pays it: the ProcessGroup wrapper, the
    enqueued record, tracking the work and completing it at wait(). The collective itself is
    replaced by a stub returning a finished work, so only our code is timed."""
    import torch

    from diag.collector.hooks import Instrumentation, _Group
    from diag.formats.journalwriter import JournalWriter
    from diag.formats.records import OpCode

    class Work:
        def is_completed(self) -> bool:
            return True

    with tempfile.TemporaryDirectory() as d:
        w = JournalWriter(Path(d) / "bench.journal", rank=0, world_size=1, local_rank=0)
        inst = Instrumentation(w, lambda *a: None)
        pg, work = object(), Work()
        inst._groups[id(pg)] = _Group(0, (0,))
        args = ([torch.ones(1024)], object())
        stub = lambda pg, *a, **k: work  # noqa: E731
        t0 = time.perf_counter()
        for _ in range(n):
            inst._host.on_wait(inst._run(stub, OpCode.ALL_REDUCE, pg, args, {}))
        return (time.perf_counter() - t0) / n * 1e6


def _worker(mode: str, blocks: int, out: str, gpu: bool = False, hidden: int = 4096,
            layers: int = 4) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    if gpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    device = "cuda" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    rank = dist.get_rank()
    from diag.trainer.attach import attach

    run_dir = tempfile.TemporaryDirectory(prefix="diag-bench-")
    session = attach(run_dir=run_dir.name)
    inst = session.instrumentation
    results: dict[str, list[float]] = {"off": [], "on": []}
    if mode == "ops":
        x = torch.ones(1, device=device)
        n = 400
        for _ in range(2):
            dist.all_reduce(x)
        for b in range(blocks * 2):
            on = b % 2 == 1
            (inst.install if on else inst.uninstall)()
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            sync()
            results["on" if on else "off"].append((time.perf_counter() - t0) / n * 1e6)
    else:
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        torch.manual_seed(0)
        h = hidden if gpu else 512
        blocks_of = [
            m
            for _ in range(layers if gpu else 1)
            for m in (torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
        ]
        model = torch.nn.Sequential(*blocks_of)
        batch = 4096 if gpu else 32
        cfg = {
            "train_micro_batch_size_per_gpu": batch,
            "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 2},
        }
        if gpu:
            cfg["bf16"] = {"enabled": True}
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, dist_init_required=False
        )
        plain_step = engine.step
        session.hook_engine(engine)
        hooked_step = engine.step
        x = torch.randn(batch, h, device=engine.device, dtype=next(engine.parameters()).dtype)
        steps = 25
        for b in range(blocks * 2 + 1):
            on = b % 2 == 1
            (inst.install if on else inst.uninstall)()
            engine.step = hooked_step if on else plain_step
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = (engine(x) - x).pow(2).mean()
                engine.backward(loss)
                engine.step()
            sync()
            if b > 0:  # the first block warms up
                results["on" if on else "off"].append((time.perf_counter() - t0) / steps * 1e3)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()
    run_dir.cleanup()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode: str, blocks: int, gpu: bool = False, nproc: int = 2,
              extra: tuple[str, ...] = ()) -> dict[str, list[float]]:  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        quiet = subprocess.DEVNULL if not gpu else None  # on a GPU machine, show what failed
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-port", str(_port()), __file__, "--worker", mode, "--blocks", str(blocks),
             "--out", f.name, *(["--gpu"] if gpu else []), *extra],
            check=True, env=env, stdout=quiet, stderr=quiet,
        )  # fmt: skip
        return json.loads(Path(f.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--worker", choices=("ops", "steps"))
    p.add_argument("--out")
    p.add_argument("--gpu", action="store_true", help="NCCL ranks on CUDA, a bf16 model")
    p.add_argument("--hidden", type=int, default=4096, help="--gpu: model width")
    p.add_argument("--layers", type=int, default=4, help="--gpu: MLP blocks")
    p.add_argument("--json", help="write the measurements here")
    a = p.parse_args()
    if a.worker:
        _worker(a.worker, a.blocks, a.out, a.gpu, a.hidden, a.layers)
        # A ZeRO rank leaves without finalizing the interpreter (gloo teardown race).
        from diag.trainer import exit_process

        exit_process(0)
    if a.gpu:
        return gpu_main(a)
    print(f"journal append+complete: {journal_cost():.2f} us per op (single process)")
    print(f"instrumented op, host cost (wrapper + journal + completion): {wrapper_cost():.2f} us")
    ops = run_ranks("ops", a.blocks)
    steps = run_ranks("steps", a.blocks)
    off, on = statistics.median(ops["off"]), statistics.median(ops["on"])
    print("\n| measure | without attach | with attach | difference | ratio |")
    print("|---|---|---|---|---|")
    print(
        f"| all_reduce of 4 bytes, 2 gloo ranks (us/op, median of {a.blocks} blocks) | "
        f"{off:.1f} | {on:.1f} | {on - off:+.1f} us | {on / off:.3f} |"
    )
    off, on = statistics.median(steps["off"]), statistics.median(steps["on"])
    print(
        f"| ZeRO-2 step, 2 CPU ranks, 2.1M params (ms/step, median of {a.blocks} blocks) | "
        f"{off:.2f} | {on:.2f} | {on - off:+.2f} ms | {on / off:.3f} |"
    )
    print(f"\nblocks (ms/step) off: {[round(v, 2) for v in steps['off']]}")
    print(f"blocks (ms/step) on:  {[round(v, 2) for v in steps['on']]}")


def gpu_main(a: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        print("--gpu: no CUDA device here", file=sys.stderr)
        sys.exit(2)
    nproc = min(2, torch.cuda.device_count())
    name = torch.cuda.get_device_name(0)
    extra = ("--hidden", str(a.hidden), "--layers", str(a.layers))
    ops = run_ranks("ops", a.blocks, True, nproc, extra)
    steps = run_ranks("steps", a.blocks, True, nproc, extra)
    med = statistics.median
    rows = {
        "all_reduce_4_bytes_us": (med(ops["off"]), med(ops["on"])),
        "zero2_bf16_step_ms": (med(steps["off"]), med(steps["on"])),
    }
    print(f"\n{name}, {nproc} NCCL rank(s), median of {a.blocks} interleaved blocks")
    print("| measure | without attach | with attach | difference | ratio |")
    print("|---|---|---|---|---|")
    for label, (off, on) in rows.items():
        print(f"| {label} | {off:.3f} | {on:.3f} | {on - off:+.3f} | {on / off:.4f} |")
    print(f"\nblocks (ms/step) off: {[round(v, 2) for v in steps['off']]}")
    print(f"blocks (ms/step) on:  {[round(v, 2) for v in steps['on']]}")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "device": name,
                    "nproc": nproc,
                    "hidden": a.hidden,
                    "layers": a.layers,
                    "blocks": a.blocks,
                    "ops_us": ops,
                    "steps_ms": steps,
                    "ratio": {k: on / off for k, (off, on) in rows.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    with private_tmpdir():
        main()
