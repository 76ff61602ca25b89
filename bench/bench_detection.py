"""Detection latency: a rank of a CPU DeepSpeed job hangs; how long until someone says so?

Side by side, the same job and fault:
- diag: a real `diag agent` with its default limits (floor 10 s, 5 x step time, ceiling 300 s);
  we report fault -> verdict, limit expiry -> verdict, and verdict -> evidence of every rank on
  disk (Python stacks first, then native stacks).
- torch alone: the job's collective timeout (the gloo/NCCL timeout users rely on today; 60 s here
  instead of the 10-30 min defaults to keep the run short): fault -> the timeout error.

    python bench/bench_detection.py [--nproc 8]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scratch import private_tmpdir

from diag.cli.demo import DemoSettings, run_demo

PG_TIMEOUT = 60.0


def _fault_time(log: Path) -> float:
    m = re.search(r"injecting hang at ([0-9.]+)", log.read_text(errors="replace"))
    if not m:
        raise RuntimeError(f"no fault in {log}")
    return float(m.group(1))


def ours(nproc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="diag-bench-") as d:
        opts = DemoSettings(
            nproc=nproc,
            fault="hang",
            fault_rank=nproc - 1,
            fault_step=8,
            steps=200,
            hang_timeout=300.0,
            hang_floor=10.0,
            workdir=Path(d),
            merge=False,
            timeout=400,
            job_args=("--pg-timeout", str(PG_TIMEOUT)),
        )
        result = run_demo(opts, out=open(os.devnull, "w"))  # noqa: SIM115
        v = result.verdict
        if v is None:
            raise RuntimeError("no verdict; see " + d)
        fault = _fault_time(Path(d) / "job.log")
        detected = dt.datetime.fromisoformat(v["detected_at"]).timestamp()
        ev = v["evidence"]
        return {
            "culprit": v["culprit"],
            "fault_to_verdict": detected - fault,
            "expiry_to_verdict": v["limit_expired_s_before_verdict"],
            "limit": v["overdue"][0]["limit_s"],
            "evidence_on_disk": ev["on_disk_seconds"],
            "native_stacks": ev["stack_seconds"],
            "ranks": len(ev["ranks"]),
        }


def torch_alone(nproc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="diag-bench-") as d:
        log = Path(d) / "job.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", DIAG_RUN_DIR=str(Path(d) / "run"))
        t0 = time.time()
        with open(log, "wb") as f:
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", "29593", "-m", "diag.trainer.demo_job", "--no-attach",
                 "--steps", "200", "--fault", "hang", "--fault-rank", str(nproc - 1),
                 "--fault-step", "8", "--pg-timeout", str(PG_TIMEOUT)],
                env=env, stdout=f, stderr=subprocess.STDOUT, timeout=PG_TIMEOUT * 4,
            )  # fmt: skip
        text = log.read_text(errors="replace")
        fault = _fault_time(log)
        # The first rank to report the timeout: torchrun stamps each failure.
        m = re.search(r"(?i)timed out|timeout", text)
        return {
            "fault_to_error": time.time() - fault,
            "timeout_seen": bool(m),
            "wall": time.time() - t0,
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=8)
    a = p.parse_args()
    o = ours(a.nproc)
    t = torch_alone(a.nproc)
    print(f"\n{a.nproc} CPU ranks, DeepSpeed ZeRO-2, rank {a.nproc - 1} hangs\n")
    print("| | diag agent | torch collective timeout | ratio |")
    print("|---|---|---|---|")
    print(
        f"| fault -> detection (s) | {o['fault_to_verdict']:.2f} (limit {o['limit']:.1f} s) | "
        f"{t['fault_to_error']:.2f} (timeout {PG_TIMEOUT:.0f} s) | "
        f"{t['fault_to_error'] / o['fault_to_verdict']:.1f}x sooner |"
    )
    print(f"| limit expiry -> verdict (s) | {o['expiry_to_verdict']:.2f} | - | |")
    print(f"| culprit named | rank {o['culprit']} | no | |")
    print(
        f"| verdict -> stacks of {o['ranks']} ranks on disk (s) | {o['evidence_on_disk']:.2f} | "
        "none | |"
    )
    print(
        f"| verdict -> native stacks of {o['ranks']} ranks (s) | {o['native_stacks']:.2f} | "
        "none | |"
    )
    print(json.dumps({"diag": o, "torch": t}))


if __name__ == "__main__":
    with private_tmpdir():
        main()
