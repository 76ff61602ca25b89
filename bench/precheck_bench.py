"""Benchmark of `diag precheck` on simulated nodes (network namespaces on one host, root only).

1. Wall time for 2, 4 and 8 healthy nodes with default settings, next to the reference: one
   gloo allreduce over all nodes at once (bench/allreduce_baseline.py), which measures the job's
   bus bandwidth but cannot name a node.
2. One node's link shaped with tbf at several rates: the busbw precheck reports for that node
   against the shaped rate, and what the all-node allreduce sees under the same shaping.

    .venv/bin/python bench/precheck_bench.py [--nodes 2,4,8] [--rates 50mbit,100mbit,200mbit]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
import repo  # noqa: E402  (tests/support: where every helper folder is)

repo.on_sys_path()

from netlab import Cluster, NetLab, netns_unavailable  # noqa: E402

from diag.agent.node.units import fmt_rate, parse_rate  # noqa: E402

PORT = 29500
BASE_FLAGS = ["--rdzv-timeout", "120", "--straggler-ratio", "0.5"]


def run_precheck(net: NetLab, n: int, workdir: Path, port: int) -> tuple[float, dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    c = Cluster(n, workdir, port, net, base_flags=BASE_FLAGS)
    t0 = time.monotonic()
    try:
        c.start_all()
        rcs = c.wait_all(600)
        wall = time.monotonic() - t0
    finally:
        c.stop()
    if any(rc not in (0, 4) for rc in rcs.values()):
        raise SystemExit(f"precheck failed: {rcs}\n{c.logs()}")
    return wall, c.nodes[0].report()


def run_baseline(
    net: NetLab, n: int, port: int, msg_bytes: int, budget: float
) -> tuple[float, float]:
    script = str(REPO / "bench" / "allreduce_baseline.py")
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                net.ns(r),
                sys.executable,
                script,
                net.addr(0),
                str(port),
                str(n),
                str(r),
                net.addr(r),
                str(msg_bytes),
                str(budget),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(n)
    ]
    outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    return time.monotonic() - t0, min(o["busbw"] for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--rates", default="50mbit,100mbit,200mbit")
    ap.add_argument("--shape-nodes", type=int, default=4, help="cluster size for the shaped runs")
    args = ap.parse_args()
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"precheck bench: {reason}")
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.node()} {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    msg, budget = 8 << 20, 1.0  # the precheck's CPU defaults, used for the baseline too
    port = PORT
    with TemporaryDirectory() as tmp:
        print("\n## Wall time, healthy nodes (default settings)")
        print(
            "| nodes | rounds | precheck wall s | precheck verdict s | all-node allreduce wall s "
            "| ratio | precheck median busbw | all-node busbw |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for n in (int(x) for x in args.nodes.split(",")):
            net = NetLab(n)
            try:
                net.build()
                wall, report = run_precheck(net, n, Path(tmp) / f"h{n}", port)
                port += 1
                base_wall, base_bw = run_baseline(net, n, port, msg, budget)
                port += 1
            finally:
                net.close()
            print(
                f"| {n} | {len(report['rounds'])} | {wall:.1f} | {report['wall_seconds']:.1f} "
                f"| {base_wall:.1f} | {wall / base_wall:.2f} "
                f"| {fmt_rate(report['median_busbw_bytes_per_s'])} | {fmt_rate(base_bw)} |"
            )

        n = args.shape_nodes
        print(f"\n## One shaped link among {n} nodes (node 1, tbf both directions)")
        print(
            "| tbf rate | rate B/s | precheck busbw of node 1 | measured / rate | verdict "
            "| all-node allreduce busbw | measured / rate |"
        )
        print("|---|---|---|---|---|---|---|")
        for rate in args.rates.split(","):
            net = NetLab(n)
            try:
                net.build()
                net.shape(1, rate)
                _, report = run_precheck(net, n, Path(tmp) / f"s{rate}", port)
                port += 1
                _, base_bw = run_baseline(net, n, port, msg, budget)
                port += 1
            finally:
                net.close()
            rate_bps = parse_rate(rate)
            node = report["nodes"][1]
            bw = node["busbw_bytes_per_s"] or 0.0
            verdict = f"stragglers {report['stragglers']}, faulty {report['faulty']}"
            print(
                f"| {rate} | {fmt_rate(rate_bps)} | {fmt_rate(bw)} | {bw / rate_bps:.2f} "
                f"| {verdict} | {fmt_rate(base_bw)} | {base_bw / rate_bps:.2f} |"
            )


if __name__ == "__main__":
    main()
