"""What an early hang costs: a fault in the first steps of a launch, and one soon after a restart.

    python bench/early_fault.py [--hang-step 25] [--hang-attempts 0] [--step-time 0.17]

A 2-rank DeepSpeed ZeRO-2 CPU job (tests/support/jobs/early_hang_job.py) under torchrun (c10d rendezvous,
`--max-restarts 2`), attached, a FlashCheckpointer saving every step, and `diag agent --on-hang
stop` with its default limits. In each attempt named by --hang-attempts, rank 1 sleeps at the
--hang-step-th step of that attempt; the agent finds the hang and stops the ranks, torchrun
restarts them and they resume from memory. For each incident: the verdict's limit and its basis,
fault -> verdict, and fault -> the restarted ranks' first step (restore included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "tests" / "support" / "jobs" / "early_hang_job.py"


@dataclass(frozen=True)
class Fault:
    attempt: int
    hang_step: int
    hung_at: float  # monotonic
    verdict: dict
    verdict_at: float  # monotonic, from the incident's detected_at
    restored_at: float | None  # the next attempt's ranks restored
    first_step_at: float | None  # the next attempt's first step done (both ranks)
    steps_again: int  # steps trained again after the restore

    @property
    def limit_s(self) -> float:
        return max(o["limit_s"] for o in self.verdict.get("overdue", []))

    @property
    def bases(self) -> list[str]:
        return [
            f"rank {o['rank']}: {o['limit_s']} s ({o['limit_basis']})"
            for o in self.verdict["overdue"]
        ]


@dataclass(frozen=True)
class Result:
    rc: int
    faults: list[Fault]
    log: str


def _rows(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _verdicts(timeline: Path) -> list[tuple[float, dict]]:
    found = []
    for v in sorted(timeline.rglob("verdict.json")):
        doc = json.loads(v.read_text())
        if doc.get("kind") in ("hang", "no_progress"):
            found.append((v.stat().st_mtime, doc))
    return found


def run(
    root: Path,
    *,
    hang_step: int = 25,
    hang_attempts: str = "0",
    hang_where: str = "step",
    step_time: float = 0.17,
    steps: int = 60,
    timeout: float = 400.0,
    agent_args: tuple[str, ...] = (),
) -> Result:
    """Runs the scenario under `root` (kept: logs, the timeline, the steps)."""
    sys.path.insert(0, str(HERE.parent / "tests" / "support"))
    import repo

    repo.on_sys_path()
    import jobrun

    run_dir = Path(tempfile.mkdtemp(prefix="diag-early-run-", dir="/dev/shm"))
    os.chmod(run_dir, 0o700)
    out, timeline = root / "out", root / "timeline"
    env = dict(
        os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )  # fmt: skip
    agent_log = open(root / "agent.log", "wb")  # noqa: SIM115 - the agent owns it
    agent = subprocess.Popen(
        [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
         "--timeline", str(timeline), "--native-stacks", "false", "--on-hang", "stop",
         *agent_args],
        env=env, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    agent_log.close()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{jobrun.free_port()}",
        "--max-restarts", "2", str(JOB), "--save-dir", str(root / "ckpt"), "--out", str(out),
        "--hang-step", str(hang_step), "--hang-attempts", hang_attempts, "--hang-where", hang_where,
        "--step-time", str(step_time), "--steps", str(steps),
    ]  # fmt: skip
    try:
        rc = jobrun.run(cmd, root / "job.log", env, timeout=timeout)
    finally:
        jobrun.stop(agent)
        shutil.rmtree(run_dir, ignore_errors=True)
    rows = _rows(out)
    verdicts = _verdicts(timeline)
    faults = []
    for hang in (r for r in rows if "hang" in r):
        a = hang["attempt"]
        after = [r for r in rows if r["attempt"] == a + 1]
        restored = [r for r in after if "restored" in r]
        firsts = {}
        for r in after:
            if "step" in r and r["rank"] not in firsts:
                firsts[r["rank"]] = r["t"]
        # The verdict of this fault: the first one written after the rank stopped.
        wall_hung = time.time() - (time.monotonic() - hang["t"])
        mine = [(t, d) for t, d in verdicts if t >= wall_hung]
        verdict_wall, doc = mine[0] if mine else (float("nan"), {})
        done_before = max((r["step"] for r in rows if r["attempt"] == a and "step" in r), default=0)
        resumed = restored[0]["restored"] if restored else 0
        faults.append(
            Fault(
                attempt=a,
                hang_step=hang["hang"],
                hung_at=hang["t"],
                verdict=doc,
                verdict_at=hang["t"] + (verdict_wall - wall_hung),
                restored_at=max(r["t"] for r in restored) if len(restored) == 2 else None,
                first_step_at=max(firsts.values()) if len(firsts) == 2 else None,
                steps_again=max(0, done_before - resumed),
            )
        )
    log = (root / "agent.log").read_text(errors="replace")[-3000:]
    log += (root / "job.log").read_text(errors="replace")[-3000:]
    return Result(rc, faults, log)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hang-step", type=int, default=25)
    p.add_argument("--hang-attempts", default="0")
    p.add_argument("--hang-where", choices=("step", "save"), default="step")
    p.add_argument("--step-time", type=float, default=0.17)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--keep", help="directory for logs and the timeline (default: a temp one)")
    args = p.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="diag-early-fault-"))
    root.mkdir(parents=True, exist_ok=True)
    res = run(
        root, hang_step=args.hang_step, hang_attempts=args.hang_attempts, hang_where=args.hang_where,
        step_time=args.step_time, steps=args.steps,
    )  # fmt: skip
    print(f"job rc {res.rc}; {len(res.faults)} fault(s); files under {root}")
    for f in res.faults:
        print(f"attempt {f.attempt}: rank stopped at step {f.hang_step}")
        for b in f.bases:
            print(f"  limit {b}")
        print(f"  fault -> verdict: {f.verdict_at - f.hung_at:.1f} s (mtime of verdict.json)")
        if f.restored_at is not None:
            print(f"  fault -> restarted ranks restored: {f.restored_at - f.hung_at:.1f} s")
        if f.first_step_at is not None:
            print(f"  fault -> restarted ranks' first step: {f.first_step_at - f.hung_at:.1f} s")
        print(f"  steps trained again: {f.steps_again}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
