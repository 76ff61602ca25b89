"""How long the other ranks of a DeepSpeed job take to leave once one rank is SIGKILLed, with
plain torchrun and with `graceful_exit` (+ a flash checkpointer), side by side.

    .venv/bin/python bench/deadpeer_bench.py --repeats 3 [--nodes 2]

tests/support/jobs/drain_job.py (ZeRO-2, gloo, CPU, 0.05 s of idle per step), --ranks ranks in all:
one torchrun, or with --nodes 2 two torchruns meeting through a c10d rendezvous (each its own
"node"). Once every rank has done 5 steps, the bench SIGKILLs one rank (local rank 1 of the last
node) and times, from the kill, each other rank's exit (first and last) and the launchers'.
The variants: `plain` (--no-drain: no diag at all) and `graceful` (graceful_exit with a
FlashCheckpointer, no agent). Prints the medians and graceful/plain ratios.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "support" / "jobs" / "drain_job.py"
VARIANTS = {"plain": ("--no-drain",), "graceful": ("--flash",)}


@dataclass(frozen=True)
class Run:
    first_gone: float
    last_gone: float
    launchers_gone: float
    codes: tuple[int, ...]  # the launchers' exit codes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def one(variant: str, ranks: int, nodes: int, root: Path) -> Run:
    out, ckpt = root / "out", root / "ckpt"
    per_node = ranks // nodes
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1", DIAG_RUN_DIR=str(root / "run"))
    launchers = []
    for node in range(nodes):
        if nodes == 1:
            where = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        else:
            where = [
                "--nnodes", str(nodes), "--node-rank", str(node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", root.name,
            ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(per_node),
            *where, "--max-restarts", "0", str(JOB), "--steps", "100000", "--step-sleep", "0.05",
            "--save-dir", str(ckpt), "--out", str(out), *VARIANTS[variant],
        ]  # fmt: skip
        log = open(root / f"node{node}.log", "wb")  # noqa: SIM115
        launchers.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            files = [out / f"progress-r{r}.txt" for r in range(ranks)]
            if all(f.exists() and len(f.read_text().splitlines()) >= 5 for f in files):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the job did not start: see {root}")
        workers = [pid for p in launchers for pid in _children(p.pid)]
        victim = _children(launchers[-1].pid)[1]
        others = set(workers) - {victim}
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        gone: dict[int, float] = {}
        while (others - set(gone) or any(p.poll() is None for p in launchers)) and (
            time.monotonic() - t0 < 120
        ):
            for pid in others - set(gone):
                if not _alive(pid):
                    gone[pid] = time.monotonic() - t0
            time.sleep(0.01)
        codes = tuple(p.wait(60) for p in launchers)
        ended = time.monotonic() - t0
        return Run(min(gone.values()), max(gone.values()), ended, codes)
    finally:
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    args = ap.parse_args()
    print(f"load: {os.getloadavg()}")
    runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    for i in range(args.repeats):
        for variant in VARIANTS:  # interleaved: both see the same load
            with tempfile.TemporaryDirectory(prefix="diag-deadpeer-") as d:
                run = one(variant, args.ranks, args.nodes, Path(d))
            runs[variant].append(run)
            print(
                f"{i} {variant:8s} first gone {run.first_gone:6.2f} s  last gone "
                f"{run.last_gone:6.2f} s  launchers gone {run.launchers_gone:6.2f} s  "
                f"codes {run.codes}",
                flush=True,
            )
    med = {
        v: [statistics.median(getattr(r, k) for r in rs)
            for k in ("first_gone", "last_gone", "launchers_gone")]
        for v, rs in runs.items()
    }  # fmt: skip
    print(f"load: {os.getloadavg()}")
    print(f"{'median':10s} {'first gone':>11s} {'last gone':>10s} {'launchers':>10s}")
    for v, (a, b, c) in med.items():
        print(f"{v:10s} {a:10.2f}s {b:9.2f}s {c:9.2f}s")
    ratios = [
        g / p if p else float("nan") for g, p in zip(med["graceful"], med["plain"], strict=True)
    ]
    print("graceful/plain " + " ".join(f"{r:.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
