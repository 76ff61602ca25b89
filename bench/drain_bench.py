"""Seconds from SIGTERM to the step committed on storage, a pod deleted with ~1 GB of state.

    .venv/bin/python bench/drain_bench.py               # 2 CPU ranks, ZeRO-2, --hidden 4000

The job is tests/support/jobs/pod_job.py (a 2-rank DeepSpeed ZeRO-2 model, fp32 Adam; --hidden 4000 is 64M
parameters, ~1 GB of checkpoint state over the two ranks), run under torchrun in a process group
of its own. At a moment after --warm-steps steps, SIGTERM goes to the group (and, for diag, to the
agent, as a classic sidecar gets it). Side by side, in one run:

- diag: flash checkpoint in memory every step, `graceful_exit` and a real `diag agent` that
  drains: EXIT to the ranks, their flash save, the agent's persist and commit;
- DeepSpeed's save on SIGTERM: `graceful_exit` without flash, so the ranks write the step with
  `engine.save_checkpoint` themselves (fsynced, `latest` last) before leaving;
- no drain (the agent as it was: `--drain false --persist-on-incident false`): what storage
  holds is the last periodic persist (every --persist-every steps): how many steps a deletion
  loses.

Measured: SIGTERM -> `latest` names a step at least the last step every rank had completed
(polled every 10 ms), and SIGTERM -> the launcher (and agent) gone. Median of --repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scratch import private_tmpdir

ROOT = Path(__file__).resolve().parent.parent
JOB_SCRIPT = ROOT / "tests" / "support" / "jobs" / "pod_job.py"
JOB = "drainbench"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4000, help="64M parameters at 4000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-steps", type=int, default=4)
    p.add_argument("--persist-every", type=int, default=3)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--modes", default="diag,deepspeed,none", help="which of the three to run")
    p.add_argument("--keep", action="store_true", help="keep each run's logs and checkpoints")
    return p.parse_args(argv)


@dataclass
class Result:
    commit_s: float | None  # SIGTERM -> latest >= the last complete step (None: never)
    next_s: float | None  # SIGTERM -> latest >= the step in flight at SIGTERM (the drain's save)
    gone_s: float  # SIGTERM -> launcher (and agent) exited
    lost_steps: int  # steps complete at SIGTERM that storage does not hold
    state_mb: float


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latest(save: Path) -> int:
    try:
        return int((save / "latest").read_text().removeprefix("global_step"))
    except (OSError, ValueError):
        return -1


def _last_step(out: Path) -> int:
    steps = []
    for rank in (0, 1):
        p = out / f"progress-r{rank}.txt"
        lines = p.read_text().split("\n") if p.exists() else []
        done = [int(x.split()[0]) for x in lines if " " in x]
        steps.append(done[-1] if done else 0)
    return min(steps)


def run_once(args: argparse.Namespace, mode: str, work: Path) -> Result:
    save, out = work / "ckpt", work / "out"
    run_dir = Path(tempfile.mkdtemp(prefix="diag-bench-drain-", dir="/dev/shm"))
    env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_JOB=JOB, OMP_NUM_THREADS="1")
    agent = job = None
    job_args = ["--hidden", str(args.hidden), "--steps", "100000"]
    if mode == "diag":
        job_args += ["--drain"]
    elif mode == "deepspeed":
        job_args += ["--drain", "--no-flash"]
    else:
        job_args += ["--persist-every", str(args.persist_every)]
    try:
        if mode != "deepspeed":
            agent = subprocess.Popen(
                [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
                 "--job", JOB, "--timeline", str(work / "tl"), "--native-stacks", "false",
                 "--termination-grace", str(args.grace), "--interval", "0.25", "-v",
                 *(["--drain", "false", "--persist-on-incident", "false"]
                   if mode == "none" else [])],
                env=env, stdout=open(work / "agent.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            sock = run_dir / f"{JOB}.control.sock"
            deadline = time.monotonic() + 60
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(_port()), "--max-restarts", "0",
             str(JOB_SCRIPT), "--save-dir", str(save), "--out", str(out), *job_args],
            env=env, stdout=open(work / "job.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while _last_step(out) < args.warm_steps:
            if job.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: the job did not train: see {work / 'job.log'}")
            time.sleep(0.05)
        time.sleep(0.3)
        done = _last_step(out)
        sent = time.monotonic()
        os.killpg(job.pid, signal.SIGTERM)
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
        commit_s = next_s = None
        hard = sent + args.grace
        while time.monotonic() < hard:
            latest = _latest(save)
            if commit_s is None and latest >= done:
                commit_s = time.monotonic() - sent
            if next_s is None and latest > done:
                next_s = time.monotonic() - sent
            if job.poll() is not None and (agent is None or agent.poll() is not None):
                break
            time.sleep(0.01)
        gone_s = time.monotonic() - sent
        if commit_s is None and _latest(save) >= done:
            commit_s = gone_s
        latest = _latest(save)
        step_dir = save / f"global_step{latest}"
        state = sum(f.stat().st_size for f in step_dir.iterdir()) if step_dir.is_dir() else 0
        return Result(commit_s, next_s, gone_s, max(0, done - max(latest, 0)), state / 1e6)
    finally:
        for p in (job, agent):
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL) if p is job else p.kill()
                p.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    modes = ("diag", "deepspeed", "none")
    chosen = args.modes.split(",")
    results: dict[str, list[Result]] = {m: [] for m in modes}
    for i in range(args.repeats):
        for mode in (m for m in modes if m in chosen):
            work = Path(tempfile.mkdtemp(prefix=f"diag-bench-drain-{mode}-", dir=args.disk_dir))
            try:
                r = run_once(args, mode, work)
            finally:
                if not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
            results[mode].append(r)
            print(f"run {i + 1} {mode}: {r}" + (f" ({work})" if args.keep else ""), flush=True)

    def med(values: list[float | None]) -> str:
        if not values:
            return "-"
        got = [v for v in values if v is not None]
        if len(got) < len(values):
            return f"never ({len(values) - len(got)} of {len(values)})"
        return f"{statistics.median(got):.2f}"

    print()
    print(
        f"{dt.date.today()} {platform.node()} {os.cpu_count()} cores, hidden {args.hidden}, "
        f"grace {args.grace:g} s, median of {args.repeats}"
    )
    print("| | diag (agent drain) | DeepSpeed save_checkpoint on SIGTERM | no drain |")
    print("|---|---|---|---|")
    row = [med([r.commit_s for r in results[m]]) for m in modes]
    print(f"| SIGTERM -> last complete step committed (s) | {row[0]} | {row[1]} | - |")
    row = [med([r.next_s for r in results[m]]) for m in modes]
    print(f"| SIGTERM -> the step in flight committed (s) | {row[0]} | {row[1]} | - |")
    row = [med([r.gone_s for r in results[m]]) for m in modes]
    print(f"| SIGTERM -> job (and agent) gone (s) | {row[0]} | {row[1]} | {row[2]} |")
    lost = [med([float(r.lost_steps) for r in results[m]]) for m in modes]
    print(f"| steps lost (median) | {lost[0]} | {lost[1]} | {lost[2]} |")
    mb = [med([r.state_mb for r in results[m]]) for m in modes]
    print(f"| checkpoint on storage (MB) | {mb[0]} | {mb[1]} | {mb[2]} |")
    d = [r.commit_s for r in results["diag"]]
    s = [r.commit_s for r in results["deepspeed"]]
    if all(v is not None for v in d + s):
        ratio = statistics.median(s) / statistics.median(d)  # type: ignore[type-var]
        print(f"\nDeepSpeed's save on SIGTERM / diag's drain: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    with private_tmpdir():
        rc = main()
    sys.exit(rc)
