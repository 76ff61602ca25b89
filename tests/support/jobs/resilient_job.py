"""The job of the in-place recovery tests: a small DeepSpeed model trained under
`diag.trainer.resilient`, whose data depends only on the step, so the steps trained after a
recovery can be compared with an uninterrupted run.

    torchrun --nproc-per-node 2 tests/support/jobs/resilient_job.py --zero 1,2,3 --steps 8 \
        --save-dir D --out O --hang-steps 3,5 --hang-rank 1 --timeout 3

For each ZeRO stage, in the same processes: an uninterrupted run (O/z<stage>/reference.jsonl,
unless --no-reference), then the run with faults: --hang-rank hangs in Python right after the
flash save of step K_i for its i-th hang (--hang-mode sleep: a long time.sleep; spin: a busy
Python loop; gil: stuck in C with the GIL held, for the agent to stop; kill: SIGKILL, for diag
launch to replace the rank; interrupt: asleep, after `diag.trainer.resilient.interrupt` from
another thread, as the agent's verdict arrives over the control channel; --hang-modes gives one per
stage); its peers' next collective times out after --timeout seconds (or fails at once on a
killed peer) and every rank recovers in place. A replacement runs the script from the top and
joins the run going on (it skips the reference): with kill, give one stage. Rank 0 appends each step's loss (with the
generation) to O/z<stage>/loss.jsonl; every rank appends to O/z<stage>/attempts-<rank>.jsonl, at
the start of each attempt, where it started from and what the process holds (threads, fds,
sockets, shared-memory entries, RSS, and on a GPU the memory its allocator holds), and writes
O/z<stage>/result-<rank>.json at the end. On a GPU (DeepSpeed's accelerator) the inputs go to the
engine's device and the wrapper forms NCCL groups.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", default="2", help="ZeRO stages, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--job", default="resilient")
    p.add_argument("--hang-steps", default="", help="comma-separated, the i-th for the i-th hang")
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument(
        "--hang-modes", default="sleep",
        help="sleep, spin, gil, interrupt or kill (SIGKILL: the launcher replaces the rank), one per stage "
        "(cycled); within a stage, one per hang joined by '+' (cycled): kill+sleep",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=3.0, help="collective timeout, seconds")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument(
        "--attach", action="store_true",
        help="diag.trainer.attach(engine) in each attempt: the agent watches the job (and its "
        "hang verdict, with --on-hang recover, is what interrupts the hung rank)",
    )  # fmt: skip
    p.add_argument(
        "--plain", action="store_true",
        help="no wrapper: the script forms its group and a fault ends the process (the launcher "
        "restarts every rank; no hang after a restart): the baseline of bench/resilient_bench.py",
    )  # fmt: skip
    return p.parse_args(argv)


def probe(path: Path, record: dict) -> None:
    """What the process holds now, appended to `path`."""
    import threading

    import psutil

    proc = psutil.Process()
    with open("/proc/self/maps") as f:  # shared memory this process maps (its slots among them)
        shm_maps = {line.split()[-1] for line in f if "/dev/shm/" in line}
    run_dir = os.environ.get("DIAG_RUN_DIR", "")
    names: dict[str, int] = {}  # the OS threads by name: what a leak is made of
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            name = f.read().strip()
            names[name] = names.get(name, 0) + 1
    record.update(
        pid=proc.pid,
        started=proc.create_time(),  # a warm spare's is before the fault it took the place of
        threads=threading.active_count(),
        os_threads=proc.num_threads(),
        fds=proc.num_fds(),
        sockets=len(proc.net_connections(kind="all")),
        shm_maps=len(shm_maps),
        run_dir_entries=len(os.listdir(run_dir)) if run_dir else 0,
        rss=proc.memory_info().rss,
        thread_names=names,
        **_cuda_held(),
    )
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _cuda_held() -> dict[str, int]:
    """The GPU memory this process's allocator holds (a leaked engine keeps its parameters and
    optimizer state there); nothing without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    return {"cuda_allocated": torch.cuda.memory_allocated(),
            "cuda_reserved": torch.cuda.memory_reserved()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from dsengine import no_jit_ops

    no_jit_ops()
    modes = args.hang_modes.split(",")
    if args.plain and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        args.hang_steps = ""  # a restarted launch of the baseline does not hang again
    for i, zero in enumerate(int(z) for z in args.zero.split(",")):
        out = Path(args.out) / f"z{zero}"
        out.mkdir(parents=True, exist_ok=True)
        # A replacement (diag launch) joins the run going on: the loss stage's.
        if not args.no_reference and os.environ.get("DIAG_RESILIENT_JOIN") != "1":
            stage(args, zero, out, "reference", [], "sleep")
        hangs = [int(s) for s in args.hang_steps.split(",") if s]
        stage(args, zero, out, "loss", hangs, modes[i % len(modes)])
    return 0


def stage(args: argparse.Namespace, zero: int, out: Path, name: str, hangs: list[int],
          mode: str) -> None:  # fmt: skip
    from diag.trainer.resilient import resilient

    hung: list[int] = []  # this process's hangs so far (a spurious recovery uses none)
    calls: list[int] = []  # the generations this process trained in
    job = f"{args.job}-z{zero}-{name}"
    save_dir = Path(args.save_dir) / job

    def train(world):  # type: ignore[no-untyped-def]
        import torch
        from dsengine import tiny_config, tiny_engine

        import diag.trainer

        t0 = time.monotonic()
        torch.manual_seed(args.seed)
        h = args.hidden
        # The ranks start the engine together: its groups connect within the short timeout.
        torch.distributed.barrier()
        engine = tiny_engine(h, tiny_config(zero))
        if args.attach and hangs:  # the stage with faults: one job name per process
            diag.trainer.attach(engine, job=job)
        ckpt = diag.trainer.FlashCheckpointer(engine, save_dir, job=job, control=False)
        start = ckpt.load() or 0
        if world.generation > 0 and not calls:
            # A spare, in the place of a rank that hung (was killed) at these: not again.
            hung.extend(h for h in hangs if h <= start)
        calls.append(world.generation)
        if hangs or (args.plain and name == "loss"):  # a restarted plain launch hangs no more
            probe(out / f"attempts-{world.rank}.jsonl", {
                "generation": world.generation, "start": start,
                "restored_s": time.monotonic() - t0, "recovery_s": world.last_recovery_seconds,
                "fault": world.last_fault, "loaded_from": ckpt.stats.loaded_from,
            })  # fmt: skip
        for step in range(start + 1, args.steps + 1):
            gen = torch.Generator().manual_seed(args.seed * 1000 + step * 10 + world.rank)
            x = torch.randn(4, h, generator=gen).to(engine.device)
            loss = (engine(x) - x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            if world.rank == 0:
                with open(out / f"{name}.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss.item().hex(),
                                        "gen": world.generation, "t": time.time()}) + "\n")  # fmt: skip
            ckpt.save(step)
            due = hangs[len(hung)] if len(hung) < len(hangs) else 0
            if step == due and world.rank == args.hang_rank:
                kinds = mode.split("+")
                hung.append(step)
                (out / "hang.json").write_text(json.dumps({"step": step, "t": time.time()}))
                ckpt.wait()  # step K is in memory on this rank: the recovery restores it
                hang(kinds[(len(hung) - 1) % len(kinds)])
        ckpt.close()
        return world

    world = plain(args, train) if args.plain else resilient(timeout_s=args.timeout)(train)()
    if hangs:
        (out / f"result-{world.rank}.json").write_text(json.dumps({
            "generation": world.generation, "recoveries": world.recoveries,
            "last_fault": world.last_fault, "hung": hung,
        }))  # fmt: skip


def plain(args: argparse.Namespace, train):  # type: ignore[no-untyped-def]
    """The script as it is without the wrapper: under torchrun's restarts, from the launch's
    environment; a restarted launch does not hang again."""
    import datetime

    import torch.distributed as dist

    from diag.trainer.resilient import World

    timeout = datetime.timedelta(seconds=args.timeout)
    # As the wrapper does: the engine's groups time out after `timeout` (DeepSpeed passes none
    # to new_group), the ranks of a (re)started launch meet with time to spare (one was stopped
    # late): the same detection in both stacks of the bench.
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = World(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), restarts,
                  restarts, "", 0.0)  # fmt: skip
    try:
        return train(world)
    finally:
        dist.destroy_process_group()


def hang(mode: str) -> None:
    """Hung in Python: interruptible only by a signal handler (sleep) or between bytecodes; or
    killed (the process is gone: its peers' collectives fail, the launcher replaces it)."""
    if mode == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "gil":
        import re

        # The regex engine backtracks in C for ever and never lets go of the GIL: no signal
        # handler and no other thread of this process (its control client) runs again.
        re.match(r"(a+)+$", "a" * 64 + "!")
    if mode == "interrupt":
        import threading

        from diag.trainer.resilient import interrupt

        why = "the agent's verdict (as the control channel delivers it)"
        threading.Timer(0.5, interrupt, args=(why,)).start()
    if mode in ("sleep", "interrupt"):
        time.sleep(3600)
    else:
        n = 0
        while True:
            n += 1


if __name__ == "__main__":
    from diag.trainer import exit_process

    exit_process(main())
