"""Where a restarted DeepSpeed rank's time goes, from the launcher starting it to its first step
after restoring its flash checkpoint.

    .venv/bin/python bench/restart_path.py --repeats 2

A 2-rank DeepSpeed ZeRO-2 job (gloo, CPU, fp32 Adam, --params-m million parameters) under
torchrun with one restart allowed: it trains and saves a flash checkpoint every step; at step 3
rank 1 kills itself (SIGKILL); torchrun stops rank 0 and starts both again; the restarted ranks
restore step 3 from shared memory and train one step. Every rank stamps the wall clock (and its
CPU time) as it reaches each phase; the table is the restarted attempt's, the slowest rank's time
per phase, median of --repeats jobs:

  launcher   the kill to the first line of the restarted rank's code (torchrun noticing the
             failure, stopping the other rank, its rendezvous, starting the processes, the
             interpreter's start: a process's start time is only known to a second)
  python     the interpreter's start (CPU seconds only)
  torch      import torch
  deepspeed  import deepspeed
  diag       import diag.trainer
  rendezvous init_process_group (the ranks meet through torchrun's store)
  initialize deepspeed.initialize (the lazy imports it pulls are listed apart)
  flash      diag's FlashCheckpointer (adopts the slots the killed launch left)
  restore    FlashCheckpointer.load (the newest snapshot every rank holds, from shared memory)
  step       the first training step after the restore

Wall and CPU seconds are both printed: on a loaded machine the wall clock mostly measures the
others' work, the CPU seconds what the rank itself spent.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scratch import private_tmpdir

KILL_AT = 3
PHASES = ("python", "torch", "deepspeed", "diag", "rendezvous", "initialize", "flash", "restore",
          "step")  # fmt: skip
LAZY = ("torch._dynamo", "torch._inductor")  # modules deepspeed.initialize may import lazily


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params-m", type=float, default=34.0, help="million parameters")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the measurements here too")
    p.add_argument("--rank-side", type=Path, help=argparse.SUPPRESS)  # results dir
    return p.parse_args(argv)


# -- the ranks -----------------------------------------------------------------------------------


def rank_side(out: Path, params_m: float) -> int:
    stamps: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def mark(name: str) -> None:
        stamps[name] = time.time()
        cpu[name] = time.process_time()

    mark("python")
    import torch

    mark("torch")
    import deepspeed
    import deepspeed.ops

    mark("deepspeed")
    import diag.trainer

    mark("diag")
    import psutil
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The worker store outlives a restart here; gloo's keys of the killed attempt would be read
    # back by the restarted ranks (dead peers' addresses), so each attempt has its own prefix.
    store = dist.PrefixStore(
        f"attempt{attempt}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False),
    )
    dist.init_process_group(
        "gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
    rank = dist.get_rank()
    mark("rendezvous")
    h = 2048
    layers = max(1, round(params_m * 1e6 / (h * h + h)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(h, h) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    before = {m for m in LAZY if m in sys.modules}
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    mark("initialize")
    lazy = [m for m in LAZY if m in sys.modules and m not in before]
    ckpt = diag.trainer.FlashCheckpointer(engine, out / "ckpt", job="bench-restart", control=False)
    mark("flash")
    start = ckpt.load() or 0
    mark("restore")

    def train_step() -> None:
        x = torch.randn(2, h)
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    step = start
    while True:
        step += 1
        train_step()
        if step == start + 1:
            mark("step")
        ckpt.save(step)
        if attempt == 0 and step == KILL_AT:
            ckpt.wait()
            dist.barrier()  # both ranks hold step KILL_AT complete
            if rank == 1:
                (out / "kill.json").write_text(json.dumps({"t": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # torchrun stops this rank
        if attempt > 0:
            break
    exec_t = psutil.Process().create_time()
    doc = {"attempt": attempt, "rank": rank, "exec": exec_t, "stamps": stamps, "cpu": cpu,
           "lazy": lazy, "restored": start}  # fmt: skip
    (out / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps(doc))
    ckpt.close(remove=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- the driver ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args: argparse.Namespace, work: Path) -> dict:
    """One job, killed and restarted once; the restarted attempt's phases, per rank."""
    out = Path(tempfile.mkdtemp(prefix="restart-", dir=work))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-restart-run-", dir="/dev/shm"))
    env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_CONTROL="0", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", __file__, "--rank-side", str(out), "--params-m", str(args.params_m),
    ]  # fmt: skip
    try:
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        kill = json.loads((out / "kill.json").read_text())["t"]
        ranks = [json.loads((out / f"attempt1-rank{r}.json").read_text()) for r in (0, 1)]
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return {"kill": kill, "ranks": ranks}


def phases(job: dict) -> dict[str, float]:
    """Seconds per phase of the restarted attempt, the slowest rank's, and the total."""
    # A process's start time is known only to the second of the boot time it counts from, so the
    # wall clock starts at the first line of the rank's code: torchrun and the interpreter together.
    out: dict[str, float] = {
        "launcher": min(r["stamps"]["python"] for r in job["ranks"]) - job["kill"]
    }
    for name in PHASES:
        spans = []
        for r in job["ranks"]:
            i = PHASES.index(name)
            spans.append(r["stamps"][name] - r["stamps"][PHASES[i - 1]] if i else float("nan"))
        out[name] = max(spans)
    out["total"] = max(r["stamps"]["step"] for r in job["ranks"]) - job["kill"]
    return out


def cpu_phases(job: dict) -> dict[str, float]:
    """CPU seconds per phase of the restarted attempt (the rank's own threads), the most any
    rank spent, and in all: on a loaded machine the wall clock mostly measures the others."""
    out: dict[str, float] = {"launcher": float("nan")}
    for i, name in enumerate(PHASES):
        spans = [r["cpu"][name] - (r["cpu"][PHASES[i - 1]] if i else 0.0) for r in job["ranks"]]
        out[name] = max(spans)
    out["total"] = max(r["cpu"]["step"] for r in job["ranks"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rank_side is not None:
        rc = rank_side(args.rank_side, args.params_m)  # imports diag.trainer in its own phase
        from diag.trainer import exit_process

        exit_process(rc)
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    jobs: dict[str, list[dict]] = {"restart": []}
    try:
        for _ in range(args.repeats):
            jobs["restart"].append(run_job(args, work))
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    report(args, jobs)
    if args.json is not None:
        args.json.write_text(json.dumps(jobs, indent=1))
    return 0


def report(args: argparse.Namespace, jobs: dict[str, list[dict]]) -> None:
    med = statistics.median
    names = ("launcher", *PHASES, "total")
    wall = {v: {n: med(phases(j)[n] for j in js) for n in names} for v, js in jobs.items()}
    cpu = {v: {n: med(cpu_phases(j)[n] for j in js) for n in names} for v, js in jobs.items()}
    print(
        f"\nrestart path, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} cores, 2 CPU ranks, {args.params_m:g} M parameters, median of "
        f"{args.repeats} jobs, slowest rank per phase: wall seconds / CPU seconds\n"
    )
    variants = list(jobs)
    head = "".join(f" {v + ' wall':>16} | {v + ' CPU':>16} |" for v in variants)
    print(f"| {'phase':<44} |{head}")
    print(f"|{'-' * 46}|" + "".join(f"{'-' * 18}|{'-' * 18}|" for _ in variants))
    labels = {
        "launcher": "kill -> restarted rank's first line (wall)",
        "total": "kill -> first step after restore",
    }
    for n in names:
        cells = "".join(f" {wall[v][n]:16.3f} | {cpu[v][n]:16.3f} |" for v in variants)
        print(f"| {labels.get(n, n):<44} |{cells}")
    for v, js in jobs.items():
        lazy = sorted({m for j in js for r in j["ranks"] for m in r["lazy"]})
        restored = sorted({r["restored"] for j in js for r in j["ranks"]})
        print(
            f"{v}: restored step {restored} (killed after {KILL_AT}); imported during "
            f"deepspeed.initialize: {', '.join(lazy) or 'none of ' + str(LAZY)}"
        )


if __name__ == "__main__":
    with private_tmpdir():
        rc = main()
    sys.exit(rc)
