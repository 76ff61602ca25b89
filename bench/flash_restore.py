"""Restoring from flash-checkpoint slots, and the agent's persist of them: this tree's code against
another checkout's (an earlier commit), side by side on the same slots in one run.

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/flash_restore.py --other /tmp/base              # ZeRO-2, 67 M params
    .venv/bin/python bench/flash_restore.py --other /tmp/base --zero 3 --layers 500 --hidden 16

A one-rank DeepSpeed job (gloo, CPU, fp32 Adam) writes two complete snapshots with this tree's
FlashCheckpointer and leaves them in shared memory (the slot format is the same in both trees).
Then, in rounds, a fresh process per tree, the trees alternating which goes first: one builds
the same engine and times `FlashCheckpointer.load()` from memory (a relaunch: a new
checkpointer adopting the slots, the plan, every check and DeepSpeed's load_checkpoint); one
times the agent's persist of the newest step (CheckpointManager's request path, fsync) into a
fresh directory, the page cache flushed first. Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scratch import private_tmpdir

ROOT = Path(__file__).resolve().parent.parent
JOB = "bench-restore"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--other", type=Path, required=True, help="another checkout of diag")
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="Linear+LayerNorm blocks")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3, help="processes per tree")
    p.add_argument("--repeats", type=int, default=3, help="loads and persists per process")
    p.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--persists", type=int, default=10, help="persists per tree, one a process")
    p.add_argument("--role", choices=("write", "measure", "persist"), help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    blocks: list = []
    for _ in range(args.layers):
        blocks += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.LayerNorm(args.hidden)]
    model = torch.nn.Sequential(*blocks)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    x = torch.randn(2, args.hidden)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return engine


def checkpointer(engine, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from diag.trainer import FlashCheckpointer

    return FlashCheckpointer(engine, args.work / "save", run_dir=args.run_dir, job=JOB,
                             control=False)  # fmt: skip


def write(args: argparse.Namespace) -> int:
    """The slots both trees load: steps 1 and 2 complete, left in shared memory."""
    engine = build_engine(args)
    ckpt = checkpointer(engine, args)
    for step in (1, 2):
        ckpt.save(step, {"data_step": step})
        ckpt.wait()
    nbytes = ckpt.stats.last_save_bytes
    ckpt.close(remove=False)
    (args.work / "written.json").write_text(json.dumps({"bytes": nbytes}))
    return 0


def measure(args: argparse.Namespace) -> int:
    """In a process running the code under test: loads from memory."""
    import diag.trainer.flash.restore as restore

    engine = build_engine(args)
    loads = []
    for _ in range(args.repeats):
        ckpt = checkpointer(engine, args)
        t0 = time.perf_counter()
        step = ckpt.load()
        loads.append(time.perf_counter() - t0)
        assert step == 2 and ckpt.stats.loaded_from == "memory", (step, ckpt.stats)
        ckpt.close(remove=False)
    out = {"loads": loads, "code": os.path.realpath(restore.__file__)}
    (args.work / f"measured-{os.getpid()}.json").write_text(json.dumps(out))
    return 0


def persist(args: argparse.Namespace) -> int:
    """In a process running the code under test (no torch): one persist of the newest step."""
    import diag.agent.checkpoint.manager as manager_module
    from diag.agent.checkpoint.manager import CheckpointManager, CheckpointSettings

    target = args.work / f"persisted-{os.getpid()}"
    os.sync()  # no writeback pending from the previous one
    manager = CheckpointManager(args.run_dir, JOB, CheckpointSettings(save_dir=target))
    t0 = time.perf_counter()
    manager.request_persist(JOB, 0, 2, str(target))
    while not manager.results:
        time.sleep(0.002)
    seconds = time.perf_counter() - t0
    manager.close()
    assert manager.results[0].ok, manager.results[0]
    shutil.rmtree(target, ignore_errors=True)
    out = {"persists": [seconds], "code": os.path.realpath(manager_module.__file__)}
    (args.work / f"measured-{os.getpid()}.json").write_text(json.dumps(out))
    return 0


def child(args: argparse.Namespace, role: str, tree: Path, run_dir: Path, work: Path) -> dict:
    # The tree's own `diag` package, ahead of the editable install (its finder comes after the
    # path's on sys.meta_path).
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()), MASTER_ADDR="127.0.0.1", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT=str(_free_port()))  # fmt: skip
    cmd = [
        sys.executable, __file__, "--other", str(args.other), "--role", role,
        "--run-dir", str(run_dir), "--work", str(work), "--zero", str(args.zero),
        "--layers", str(args.layers), "--hidden", str(args.hidden),
        "--repeats", str(args.repeats),
    ]  # fmt: skip
    before = set(work.glob("measured-*.json"))
    done = subprocess.run(cmd, env=env, timeout=1800, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{role} with {tree} failed:\n{done.stderr[-4000:]}")
    if role == "write":
        return json.loads((work / "written.json").read_text())
    (new,) = set(work.glob("measured-*.json")) - before
    got = json.loads(new.read_text())
    new.unlink()
    return dict(got)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.role == "write":
        return write(args)
    if args.role == "measure":
        return measure(args)
    if args.role == "persist":
        return persist(args)
    trees = {"this": ROOT, "other": args.other}
    work = Path(tempfile.mkdtemp(prefix="bench-restore-", dir=args.disk_dir))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-restore-run-", dir="/dev/shm"))
    try:
        written = child(args, "write", ROOT, run_dir, work)
        got: dict[str, dict[str, list[float]]] = {t: {"loads": [], "persists": []} for t in trees}
        runs = [("measure", i) for i in range(args.rounds)]
        runs += [("persist", i) for i in range(args.persists)]
        for role, i in runs:
            for name in list(trees)[:: 1 if i % 2 == 0 else -1]:
                m = child(args, role, trees[name], run_dir, work)
                # the code measured is the tree's own
                assert Path(m["code"]).resolve().is_relative_to(trees[name].resolve()), m["code"]
                for key in ("loads", "persists"):
                    got[name][key] += m.get(key, [])
        report(args, written["bytes"], got)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(args: argparse.Namespace, nbytes: int, got: dict[str, dict[str, list[float]]]) -> None:
    med = statistics.median
    print(
        f"# ZeRO-{args.zero}, {args.layers} x (Linear+LayerNorm) of {args.hidden}, one rank, "
        f"{nbytes / 1e6:.1f} MB of state; loads: {args.rounds} processes x {args.repeats}, "
        f"persists: {args.persists} processes, per tree; "
        f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(f"{'seconds (median)':<36} {'this tree':>10} {'other':>10} {'this/other':>11}")
    for what, key in (("load() from memory", "loads"), ("agent persist (fsync)", "persists")):
        this, other = med(got["this"][key]), med(got["other"][key])
        print(f"{what:<36} {this:>10.3f} {other:>10.3f} {this / other:>11.3f}")
        spread = [f"{s:.3f}" for s in sorted(got["this"][key])]
        spread_other = [f"{s:.3f}" for s in sorted(got["other"][key])]
        print(f"  {'all: this':<34} {' '.join(spread)}")
        print(f"  {'all: other':<34} {' '.join(spread_other)}")


if __name__ == "__main__":
    with private_tmpdir():
        sys.exit(main())
