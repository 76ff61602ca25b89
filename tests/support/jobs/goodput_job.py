"""The job of the goodput bench (bench/goodput.py) and its test: a DeepSpeed ZeRO-2 model (on CPU
with gloo; --device cuda: on the rank's GPU with NCCL) whose data depends only on the step,
checkpointed the way one of three stacks does it, that injects the faults of a schedule on itself
and logs what it does with wall-clock times.

    torchrun ... tests/support/jobs/goodput_job.py --stack diag --save-dir D --out O --faults F \
        [--steps 60] [--hidden 64] [--every 10] [--device cpu|cuda]

--stack default: `engine.save_checkpoint` every --every steps, resume from `latest`; diag: a
`FlashCheckpointer` saving every step to memory (the agent also writes every --every-th to D),
`attach` and `graceful_exit`; dlrover: DLRover's `DeepSpeedCheckpointer`, memory every step and
storage every --every; inplace: as diag, without the drain, the training run under
`diag.trainer.resilient` (which forms the process group, and after a fault forms it again in the
same process and runs the training again from the newest step in memory). Every process group's collective timeout is --pg-timeout (torch's own
default is 30 min for gloo, 10 min for NCCL).

F is a JSON list of faults ({"id", "kind", "step", "rank"}); a rank fires the ones of kind kill
(SIGKILL itself), hang (sleeps in Python) and gil (spins in C, the GIL held) that name its global
rank, before the forward of that step, once per job (the first rank to create O/fired-<id>
fires). Each process appends one JSON line per event to O/events.jsonl: start (before the
imports), ready (process group and engine up, before the restore), restored (the step resumed
from, and `source`: memory, storage, or "" for nothing or a stack that does not say), step
(with t0, its start, and t, its end after engine.step()), saved (the checkpoint of a step taken,
t0 its start), formed and engine (the world formed, the engine built), fault, ended (inplace: a fault ended this attempt; this process goes on and logs
`ready` and `restored` again), done.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the imports: a restart pays them

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

STACKS = ("default", "diag", "dlrover", "inplace")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--stack", choices=STACKS, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--every", type=int, default=10, help="storage checkpoint every N steps")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--faults", default="", help="JSON file of faults this job injects itself")
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL")
    p.add_argument(
        "--wait-saves", action="store_true", help="a flash save's copy done before `saved`"
    )
    return p.parse_args(argv)


class Events:
    """One JSON line per event in O/events.jsonl, shared by every process (O_APPEND: a short
    line is written whole)."""

    def __init__(self, out: Path, **who: Any) -> None:
        self.fd = os.open(out / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.who = who

    def __call__(self, ev: str, t: float | None = None, **row: Any) -> None:
        line = {"ev": ev, "t": time.time() if t is None else t, **self.who, **row}
        os.write(self.fd, (json.dumps(line) + "\n").encode())


def begin(out_dir: str, t_start: float) -> tuple[Path, str]:
    """The events' folder and this process's node, once its `start` is logged (`t_start`: taken
    before the script's imports, which a restart pays)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    node = os.environ.get("DIAG_NODE", "")
    Events(out, pid=os.getpid(), node=node)("start", t=t_start)
    return out, node


def _fire(kind: str) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        time.sleep(10**6)
    elif kind == "gil":
        # The regex engine runs in C and never lets go of the GIL: no signal handler, no
        # journal thread of this process runs again.
        re.match(r"(a+)+$", "a" * 64 + "!")


def _due(faults: list[dict], out: Path, rank: int, step: int) -> dict | None:
    for f in faults:
        if f["rank"] == rank and f["step"] == step and f["kind"] in ("kill", "hang", "gil"):
            try:
                os.close(os.open(out / f"fired-{f['id']}", os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                continue
            return f
    return None


class Saver:
    """How a stack checkpoints and resumes."""

    def __init__(self, args: argparse.Namespace, engine: Any) -> None:
        self.args, self.engine = args, engine
        self.flash: Any = None
        self.dl: Any = None
        if args.stack in ("diag", "inplace"):
            import diag.trainer

            diag.trainer.attach(engine, job="goodput")
            self.flash = diag.trainer.FlashCheckpointer(engine, args.save_dir, job="goodput")
            if args.stack == "diag":  # in place, a killed node's ranks are replaced, not drained
                diag.trainer.graceful_exit(engine, args.save_dir, checkpointer=self.flash)
        elif args.stack == "dlrover":
            import sys

            from dlrover.trainer.torch.flash_checkpoint import deepspeed as dl_ds

            # DeepSpeed 0.19 hands torch.save/torch.load keyword arguments that DLRover 0.6.1's
            # stand-ins do not take: the flash bench's shim.
            sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
            from flash_checkpoint import _accept_extra_kwargs

            _accept_extra_kwargs(dl_ds.AsyncCheckpointAgent)
            self.dl = dl_ds.DeepSpeedCheckpointer(engine, args.save_dir)

    def load(self) -> tuple[int, str]:
        """The step resumed from, and where from (memory, storage; "": nothing, or unknown)."""
        if self.flash is not None:
            step = int(self.flash.load() or 0)
            return step, self.flash.stats.loaded_from
        if self.dl is not None:
            self.dl.load_checkpoint(self.args.save_dir)
            return int(self.engine.global_steps), ""
        if (Path(self.args.save_dir) / "latest").exists():
            self.engine.load_checkpoint(self.args.save_dir)
            return int(self.engine.global_steps), "storage"
        return 0, ""

    def save(self, step: int) -> bool:
        """Whether anything was saved at this step."""
        to_storage = step % self.args.every == 0
        tag = f"global_step{step}"
        if self.flash is not None:
            self.flash.save(step, persist=to_storage)
            if self.args.wait_saves:
                self.flash.wait()
            return True
        if self.dl is not None:
            from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

            kind = StorageType.DISK if to_storage else StorageType.MEMORY
            # DLRover takes the tag for the step (it compares the ranks' steps as numbers).
            self.dl.save_checkpoint(self.args.save_dir, step, storage_type=kind)
            return True
        if to_storage:
            self.engine.save_checkpoint(self.args.save_dir, tag=tag)
            return True
        return False

    def close(self) -> None:
        if self.flash is not None:
            self.flash.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out, node = begin(args.out, T_START)
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from dsengine import no_jit_ops

    no_jit_ops()
    backend = "nccl" if args.device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    c10d.default_pg_timeout = timeout  # DeepSpeed's own groups take the module's default
    if backend == "nccl":  # (NCCL groups take their own: 10 min)
        c10d.default_pg_nccl_timeout = timeout
    faults = json.loads(Path(args.faults).read_text()) if args.faults else []
    if args.stack == "inplace":
        from diag.trainer.resilient import resilient

        # The wrapper forms the process group (and each next generation) itself.
        resilient(backend=backend, timeout_s=args.pg_timeout)(attempt)(args, out, node, faults)
    else:
        dist.init_process_group(backend, timeout=timeout)
        attempt(None, args, out, node, faults)
        dist.destroy_process_group()
    return 0


def attempt(world: Any, args: argparse.Namespace, out: Path, node: str, faults: list[dict]) -> None:
    """The training: once per process, or (inplace) once per generation of the world, whose
    `ready` and `restored` then come again in the same process; `ended` when a fault ends it."""
    import torch
    import torch.distributed as dist
    from dsengine import tiny_config, tiny_engine

    rank = dist.get_rank()
    ev = Events(out, pid=os.getpid(), node=node, rank=rank)
    try:
        # (inplace) the world formed, the engine built: where a recovery's restart goes
        ev("formed", generation=getattr(world, "generation", 0))
        torch.manual_seed(args.seed)
        h = args.hidden
        engine = tiny_engine(h, tiny_config(2, lr=1e-3))
        ev("engine")
        saver = Saver(args, engine)
        ev("ready", generation=getattr(world, "generation", 0))
        start, source = saver.load()
        ev("restored", step=start, source=source)
        for step in range(start + 1, args.steps + 1):
            t0 = time.time()
            fault = _due(faults, out, rank, step)
            if fault is not None:
                ev("fault", id=fault["id"], kind=fault["kind"], step=step)
                _fire(fault["kind"])
            gen = torch.Generator().manual_seed(args.seed * 100003 + step * 10 + rank)
            x = torch.randn(4, h, generator=gen).to(engine.device)  # the same data on any device
            loss = (engine(x) - x).pow(2).mean()
            engine.backward(loss)
            engine.step()  # a drain saves and leaves in here
            if x.is_cuda:  # the step ends when its kernels have run, not when they are queued
                torch.cuda.synchronize()
            t1 = time.time()
            ev("step", step=step, t0=t0, t=t1)
            if saver.save(step):
                ev("saved", step=step, t0=t1)
        saver.close()
    except BaseException as e:
        if world is not None:  # the wrapper recovers: this process goes on
            ev("ended", why=type(e).__name__)
        raise
    ev("done")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from diag.trainer import exit_process

    exit_process(main())
