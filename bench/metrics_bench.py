"""Cost of the agent's metrics with 8 journaled ranks: scrape latency, resident memory and CPU.

    .venv/bin/python bench/metrics_bench.py [--ranks 8] [--interval 1] [--window 60]

Runs a real 8-rank gloo job (bench/collective_ranks.py under torchrun, journaled by
diag.trainer) and two real `diag agent` processes watching the same journals side by side: the
reference without `--metrics-port`, and ours with it. Phase 1 scrapes ours every 15 s (a usual
Prometheus interval), phase 2 every second; each phase measures both agents' CPU over the same
wall time. Then it times a burst of scrapes and counts the series of one scrape.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families
from scratch import private_tmpdir

from diag.agent.observe.procs import stop_tree

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return time.perf_counter() - t0, body


@dataclass
class Usage:
    cpu: float  # CPU seconds (user + system)
    wall: float

    @property
    def share(self) -> float:
        return self.cpu / self.wall if self.wall > 0 else 0.0


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(procs: dict[str, psutil.Process], seconds: float, url: str, every: float):
    """CPU of each agent over `seconds`, while scraping `url` every `every` seconds."""
    start = {k: cpu_seconds(p) for k, p in procs.items()}
    t0 = time.monotonic()
    latencies = []
    next_scrape = t0
    while (now := time.monotonic()) < t0 + seconds:
        if now >= next_scrape:
            latencies.append(scrape(url)[0])
            next_scrape += every
        time.sleep(min(0.2, max(0.0, next_scrape - time.monotonic())))
    wall = time.monotonic() - t0
    return {k: Usage(cpu_seconds(p) - start[k], wall) for k, p in procs.items()}, latencies


def series_by_group(body: str) -> Counter:
    groups: Counter = Counter()
    for fam in text_string_to_metric_families(body):
        name = fam.name
        group = (
            "per rank"
            if name.startswith("diag_rank_")
            else "collectives (per rank, op)"
            if name.startswith("diag_collective_")
            else "incidents, evidence"
            if name.startswith(("diag_incident", "diag_evidence"))
            else "host"
            if name.startswith("diag_host_")
            else "agent"
            if name.startswith("diag_agent_")
            else "xpu_timer compat"
            if name.startswith("XPU_TIMER")
            else "other"
        )
        groups[group] += len(fam.samples)
    return groups


def wait_for_journals(run_dir: Path, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(list(run_dir.glob("*.journal"))) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(list(run_dir.glob('*.journal')))} of {n} journals")
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0, help="the agents' --interval")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of phase 1")
    ap.add_argument("--fast-window", type=float, default=30.0, help="seconds of phase 2")
    ap.add_argument("--steps-per-second", type=float, default=5.0)
    ap.add_argument("--ops", type=int, default=10, help="collectives per step")
    ap.add_argument("--burst", type=int, default=50, help="scrapes timed back to back")
    args = ap.parse_args()

    with contextlib.ExitStack() as files:
        return run(args, files)


def run(args: argparse.Namespace, files: contextlib.ExitStack) -> int:
    def log(name: str):
        return files.enter_context(open(tmp / name, "wb"))

    tmp = Path(tempfile.mkdtemp(prefix="diag-metrics-bench-"))
    run_dir, timeline = tmp / "run", tmp / "timeline"
    run_dir.mkdir()
    env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_JOB="bench", OMP_NUM_THREADS="1")
    job_seconds = 60 + args.window + args.fast_window + 30
    job = subprocess.Popen(
        [
            PY, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(ROOT / "bench" / "collective_ranks.py"), "--seconds", str(job_seconds),
            "--steps-per-second", str(args.steps_per_second), "--ops", str(args.ops),
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=log("job.log"),
        start_new_session=True,
    )  # fmt: skip
    port = free_port()
    common = [
        PY, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir), "--timeline",
        str(timeline), "--job", "bench", "--interval", str(args.interval),
        # Two agents watch one run dir: only one may serve its control socket, and neither needs
        # it here.
        "--control", "false",
    ]  # fmt: skip
    agents = {
        "reference (no metrics)": subprocess.Popen(
            common, env=env, stderr=log("agent-ref.log"), start_new_session=True
        ),
        "ours (--metrics-port)": subprocess.Popen(
            [*common, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
            env=env,
            stderr=log("agent-metrics.log"),
            start_new_session=True,
        ),
    }
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        print(f"starting {args.ranks} ranks and two agents in {tmp} ...", file=sys.stderr)
        wait_for_journals(run_dir, args.ranks, timeout=180)
        time.sleep(15)  # past the first steps, the agents have read the backlog
        procs = {k: psutil.Process(p.pid) for k, p in agents.items()}
        slow, slow_lat = measure(procs, args.window, url, every=15.0)
        fast, fast_lat = measure(procs, args.fast_window, url, every=1.0)
        burst = []
        for _ in range(args.burst):
            seconds, body = scrape(url)
            burst.append(seconds)
            time.sleep(0.1)
        rss = {k: p.memory_info().rss for k, p in procs.items()}
        hwm = {k: peak_rss(p.pid) for k, p in procs.items()}
        for k, p in agents.items():
            if p.poll() is not None:
                raise SystemExit(f"agent {k} exited with {p.returncode}; see {tmp}")
        if job.poll() is not None:
            raise SystemExit(f"the job ended early ({job.returncode}); see {tmp / 'job.log'}")
        ops = sum(
            s.value
            for fam in text_string_to_metric_families(body)
            if fam.name == "diag_collective_latency_seconds"
            for s in fam.samples
            if s.name.endswith("_count")
        )
    finally:
        for p in (*agents.values(), job):
            if p.poll() is None:
                stop_tree(p.pid, grace=20)
            p.wait(timeout=10)

    ref, ours = list(agents)
    lines = [
        f"# metrics bench, {dt.date.today()}, {platform.node()}: {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        f"# {args.ranks} journaled ranks, {args.ops} collectives per step at "
        f"{args.steps_per_second:g} steps/s; agents at --interval {args.interval:g}",
        f"# scrape: {len(body.encode()) / 1024:.1f} KiB; {int(ops)} op completions in the "
        "latency histograms so far",
        "",
        f"| measure | {ref} | {ours} | ratio |",
        "|---|---|---|---|",
    ]

    def row(name: str, a: float, b: float, fmt: str) -> None:
        ratio = f"{b / a:.2f}x" if a else "-"
        lines.append(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")

    row(
        f"CPU, scraped every 15 s ({args.window:g} s)",
        100 * slow[ref].share,
        100 * slow[ours].share,
        "{:.2f}% of a core",
    )
    row(
        f"CPU, scraped every 1 s ({args.fast_window:g} s)",
        100 * fast[ref].share,
        100 * fast[ours].share,
        "{:.2f}% of a core",
    )
    row("resident memory (now)", rss[ref] / 2**20, rss[ours] / 2**20, "{:.1f} MiB")
    row("resident memory (peak)", hwm[ref] / 2**20, hwm[ours] / 2**20, "{:.1f} MiB")
    lat = sorted(burst + slow_lat + fast_lat)
    lines += [
        "",
        f"scrape latency over {len(lat)} scrapes: median {1000 * statistics.median(lat):.1f} ms, "
        f"p95 {1000 * lat[int(0.95 * (len(lat) - 1))]:.1f} ms, max {1000 * lat[-1]:.1f} ms",
        "",
        "series in one scrape:",
    ]
    groups = series_by_group(body)
    for group, n in groups.most_common():
        lines.append(f"  {group:<28} {n}")
    lines.append(f"  {'total':<28} {sum(groups.values())}")
    print("\n".join(lines))
    shutil.rmtree(tmp, ignore_errors=True)  # kept only when something failed, for its logs
    return 0


if __name__ == "__main__":
    with private_tmpdir():
        rc = main()
    raise SystemExit(rc)
