"""Collector overhead, measured side by side in one run.

1. Journal cost: one op record appended and completed (what every instrumented op pays), in a
   single process.
2. Per-op host cost: 2 gloo ranks issue tiny all_reduces in alternating blocks, with the
   instrumentation installed and removed, in the same processes.
3. Step time of a 2-rank DeepSpeed ZeRO-2 CPU job, alternating blocks of steps with and without
   `attach`, in the same processes.

    python bench/bench_collector.py [--blocks 6]
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
    from diag.collector.journal import JournalWriter
    from diag.collector.records import OpCode, OpState, RecordKind

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
    from diag.collector.journal import JournalWriter
    from diag.collector.records import OpCode

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


def _worker(mode: str, blocks: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from diag.trainer.attach import attach

    run_dir = tempfile.TemporaryDirectory(prefix="diag-bench-")
    session = attach(run_dir=run_dir.name)
    inst = session.instrumentation
    results: dict[str, list[float]] = {"off": [], "on": []}
    if mode == "ops":
        x = torch.ones(1)
        n = 400
        for _ in range(2):
            dist.all_reduce(x)
        for b in range(blocks * 2):
            on = b % 2 == 1
            (inst.install if on else inst.uninstall)()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            results["on" if on else "off"].append((time.perf_counter() - t0) / n * 1e6)
    else:
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        torch.manual_seed(0)
        h = 512
        model = torch.nn.Sequential(
            torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
        )
        cfg = {
            "train_micro_batch_size_per_gpu": 32,
            "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 2},
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, dist_init_required=False
        )
        plain_step = engine.step
        session.hook_engine(engine)
        hooked_step = engine.step
        x = torch.randn(32, h)
        steps = 25
        for b in range(blocks * 2 + 1):
            on = b % 2 == 1
            (inst.install if on else inst.uninstall)()
            engine.step = hooked_step if on else plain_step
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = (engine(x) - x).pow(2).mean()
                engine.backward(loss)
                engine.step()
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


def run_ranks(mode: str, blocks: int) -> dict[str, list[float]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(_port()), __file__, "--worker", mode, "--blocks", str(blocks),
             "--out", f.name],
            check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return json.loads(Path(f.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--worker", choices=("ops", "steps"))
    p.add_argument("--out")
    a = p.parse_args()
    if a.worker:
        _worker(a.worker, a.blocks, a.out)
        # A ZeRO rank leaves without finalizing the interpreter (gloo teardown race).
        from diag.trainer import exit_process

        exit_process(0)
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


if __name__ == "__main__":
    with private_tmpdir():
        main()
