"""A killed rank's cost: diag launch with a warm spare and `@resilient` (the survivor keeps its
process, the spare takes the dead rank) against a full restart of every worker (the job
without `@resilient`: torchrun's policy), and diag launch with no spare (`--spares 0`: the
replacement is a new process, a cold start). The same 2-rank ZeRO-2 CPU job
(tests/support/jobs/resilient_job.py), rank 1 SIGKILLed right after the flash save of a step;
the stacks alternating, side by side in one run.

The full restart runs under diag launch: plain torchrun's restart of this job mostly fails here
(torch 2.13 keeps the workers' store across restarts, and the restarted ranks' gloo connect reads
the dead rank's address, or waits for it; diag launch gives each restart a store of its own).
torchrun itself is tried once per round too (`torchrun` below): its failures (an error, or no
end within 150 s) are counted, its figure kept when it worked.

The cost is from the kill to the first step trained after it (rank 0's clock, which survives or
is restarted on the same machine).

    .venv/bin/python bench/spare_bench.py --rounds 3
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

import jobrun  # noqa: E402  (tests/support/jobs: a run whose whole process tree is reaped)

STACKS = ("spare", "cold start", "full restart", "torchrun")
RUN_TIMEOUT_S = 150  # a run takes 20-40 s; torchrun's restart may hang connecting (300 s)


def command(stack: str, root: Path, steps: int, kill_step: int) -> list[str]:
    job = [
        str(JOB), "--zero", "2", "--no-reference", "--steps", str(steps),
        "--hang-steps", str(kill_step), "--hang-modes", "kill", "--timeout", "30",
        "--save-dir", str(root / "ckpt"), "--out", str(root / "out"),
    ]  # fmt: skip
    if stack == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "1", *job, "--plain"]  # fmt: skip
    spares = "1" if stack == "spare" else "0"
    plain = ["--plain"] if stack == "full restart" else []
    # The kill comes seconds after the start: --spare-delay 0, the spare warm by then.
    return [sys.executable, "-m", "diag.cli.main", "launch", "--standalone", "--nproc-per-node",
            "2", "--max-restarts", "1", "--spares", spares, "--spare-delay", "0", *job,
            *plain]  # fmt: skip


def one(stack: str, steps: int, kill_step: int) -> dict[str, float] | None:
    """The round's figures, or None when torchrun's restart failed to connect."""
    root = Path(tempfile.mkdtemp(prefix="diag-bench-spare-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-bench-spare-run-", dir="/dev/shm"))
    env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
               PYTHONPATH=repo.pythonpath())  # fmt: skip
    try:
        proc = jobrun.start(command(stack, root, steps, kill_step), root / "job.log", env)
        try:
            rc = jobrun.finish(proc, RUN_TIMEOUT_S)  # its whole tree stopped whatever happens
        except subprocess.TimeoutExpired:
            rc = -1
        text = (root / "job.log").read_text(errors="replace")
        if rc != 0:
            if stack == "torchrun":  # its restart failed to connect, or hung connecting
                return None
            raise SystemExit(f"{stack}: the job failed ({rc}):\n{text[-3000:]}")
        out = root / "out" / "z2"
        kill = json.loads((out / "hang.json").read_text())
        lines = [json.loads(x) for x in (out / "loss.jsonl").read_text().splitlines()]
        after = [x for x in lines if x["step"] == kill["step"] + 1]
        step_s = (lines[kill_step - 1]["t"] - lines[0]["t"]) / max(1, kill_step - 1)
        return {"cost_s": after[-1]["t"] - kill["t"], "step_s": step_s}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-step", type=int, default=3)
    args = p.parse_args()
    got: dict[str, list[dict[str, float]]] = {s: [] for s in STACKS}
    failed = dict.fromkeys(STACKS, 0)
    load0 = os.getloadavg()
    for r in range(args.rounds):
        order = STACKS if r % 2 == 0 else STACKS[::-1]  # alternating
        for stack in order:
            t0 = time.monotonic()
            m = one(stack, args.steps, args.kill_step)
            if m is None:
                failed[stack] += 1
                print(f"round {r + 1} {stack:>12}: the restart failed", flush=True)
                continue
            got[stack].append(m)
            print(f"round {r + 1} {stack:>12}: kill to next step {m['cost_s']:6.2f} s, "
                  f"run {time.monotonic() - t0:5.1f} s", flush=True)  # fmt: skip
    load1 = os.getloadavg()
    med = {s: statistics.median(x["cost_s"] for x in got[s]) if got[s] else float("nan")
           for s in STACKS}  # fmt: skip
    step = statistics.median(x["step_s"] for s in STACKS for x in got[s])
    print(f"\nload average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end; medians of "
          f"{args.rounds} rounds; a step takes {step * 1000:.0f} ms")  # fmt: skip
    print(f"{'stack':>12} {'kill to next step (s)':>22} {'ratio':>6} {'runs':>5} "
          f"{'restarts that failed':>21}")  # fmt: skip
    for s in STACKS:
        print(f"{s:>12} {med[s]:>22.2f} {med[s] / med['full restart']:>6.2f} {len(got[s]):>5} "
              f"{failed[s]:>21}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
