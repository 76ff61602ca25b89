"""One hung rank's cost: recovered in place (diag.trainer.resilient) against a full restart by
torchrun (the default stack: the peers' collective times out, every process exits, torchrun
starts new ones, which import torch and DeepSpeed, build the engine, meet and restore from the
node's memory). A third stack recovers in place at the agent's verdict (`diag agent --on-hang
recover`, its hang limit set to the same seconds, the collective timeout 600 s): the agent's
evidence (stacks of every rank, native frames too) comes before the recovery. The same 2-rank ZeRO-2 CPU job (tests/support/jobs/resilient_job.py), the same
collective timeout, the same hang (rank 1 in time.sleep right after the flash save of a step),
the two stacks alternating, side by side in one run.

The cost is from the hang to the first step trained after it (rank 0's clock); less the timeout,
it is what the recovery itself takes.

    .venv/bin/python bench/resilient_bench.py --rounds 3 --timeout 3
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

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
JOB = SUPPORT / "jobs" / "resilient_job.py"
sys.path.insert(0, str(SUPPORT))
import repo  # noqa: E402  (tests/support: where every helper folder is)

repo.on_sys_path()

from jobrun import free_port  # noqa: E402

STACKS = ("in place", "agent verdict", "full restart")


def one(stack: str, timeout: float, steps: int, hang_step: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="diag-bench-resilient-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-bench-resilient-run-", dir="/dev/shm"))
    plain = stack == "full restart"
    by_agent = stack == "agent verdict"
    job_timeout = 600.0 if by_agent else timeout
    # The full restart under diag launch, which restarts every worker of a job without the
    # wrapper as torchrun does, with a fresh store per restart: torchrun's own restart of this
    # job fails here most of the time (torch 2.13 keeps the dead attempt's keys in the store).
    launcher = ["diag.cli.main", "launch"] if plain else ["torch.distributed.run"]
    cmd = [
        sys.executable, "-m", *launcher, "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "--max-restarts", "1" if plain else "0", str(JOB), "--zero", "2", "--no-reference",
        "--steps", str(steps), "--hang-steps", str(hang_step), "--timeout", str(job_timeout),
        "--save-dir", str(root / "ckpt"), "--out", str(root / "out"),
        *(["--plain"] if plain else []), *(["--attach"] if by_agent else []),
    ]  # fmt: skip
    env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
               PYTHONPATH=repo.pythonpath())  # fmt: skip
    agent = None
    if by_agent:
        agent = subprocess.Popen(
            [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
             "--timeline", str(root / "timeline"), "--hang-timeout", str(timeout),
             "--hang-floor", str(timeout), "--warmup-timeout", str(max(2 * timeout, 8.0)),
             "--on-hang", "recover", "--until", "job-end", "--interval", "0.25"],
            env=env, stdout=open(root / "agent.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )  # fmt: skip
    try:
        with open(root / "job.log", "wb") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=600, check=False).returncode  # fmt: skip
        if agent is not None:
            agent.wait(60)
        if rc != 0:
            raise SystemExit(f"{stack}: the job failed ({rc}):\n"
                             + (root / "job.log").read_text()[-3000:])  # fmt: skip
        out = root / "out" / "z2"
        hang = json.loads((out / "hang.json").read_text())
        lines = [json.loads(x) for x in (out / "loss.jsonl").read_text().splitlines()]
        after = [x for x in lines if x["step"] == hang["step"] + 1]
        before = [x for x in lines if x["step"] == hang["step"]]
        step_s = (before[-1]["t"] - lines[0]["t"]) / max(1, hang["step"] - 1)
        cost = after[-1]["t"] - hang["t"]
        return {"cost_s": cost, "less_timeout_s": cost - timeout, "step_s": step_s}
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--timeout", type=float, default=3.0,
        help="collective timeout, seconds (the agent's hang limit in the agent-verdict stack)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hang-step", type=int, default=3)
    p.add_argument(
        "--stacks", default=",".join(STACKS), help="comma-separated, of: " + ", ".join(STACKS)
    )
    args = p.parse_args()
    stacks = tuple(x.strip() for x in args.stacks.split(","))
    unknown = [x for x in stacks if x not in STACKS]
    if unknown:
        p.error(f"unknown stack(s) {unknown}: choose among {', '.join(STACKS)}")
    got: dict[str, list[dict[str, float]]] = {s: [] for s in stacks}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        for stack in stacks if r % 2 == 0 else stacks[::-1]:  # alternating
            t0 = time.monotonic()
            m = one(stack, args.timeout, args.steps, args.hang_step)
            got[stack].append(m)
            print(f"round {r + 1} {stack:>12}: hang to next step {m['cost_s']:6.2f} s "
                  f"({m['less_timeout_s']:5.2f} s past the timeout), run {time.monotonic() - t0:5.1f} s",
                  flush=True)  # fmt: skip
    load1 = os.getloadavg()
    med = {s: statistics.median(x["less_timeout_s"] for x in got[s]) for s in stacks}
    tot = {s: statistics.median(x["cost_s"] for x in got[s]) for s in stacks}
    ref = tot.get("full restart", 0.0)
    print(f"\nload average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end; "
          f"timeout {args.timeout} s; medians of {args.rounds} rounds")  # fmt: skip
    print(f"{'stack':>14} {'hang to next step (s)':>22} {'past the limit (s)':>19} "
          f"{'vs full restart':>16}")  # fmt: skip
    for s in stacks:
        ratio = tot[s] / ref if ref > 0 else float("nan")
        print(f"{s:>14} {tot[s]:>22.2f} {med[s]:>19.2f} {ratio:>16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
