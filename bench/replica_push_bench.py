"""Replica push and pull throughput between two agents' replica code on loopback: this tree against
another checkout of diag (the reference, e.g. the commit before a change), side by side in one run.

    git worktree add /tmp/diag-ref <commit>
    .venv/bin/python bench/replica_push_bench.py --ref /tmp/diag-ref --mb 384 --rounds 30

For each tree, one child process imports that tree's `diag` (a package directory of links to
its folders, first on the path), writes a node's slots (two ranks, --mb in all, in /dev/shm) and
starts the holder's replica server in a forked process of its own (another agent: its own
interpreter and GIL). Then the two trees take turns, one operation at a time, so that whatever
else loads the machine meanwhile falls on both alike: --rounds times a push by each (who goes
first alternates), then --pulls times a pull back into an empty directory by each. Prints every
tree's median and the ratio (this tree / reference; above 1 is faster), in wall time and in CPU
time (both agents' processes together: what an operation costs the node's CPUs, and a figure
other load on the machine sways less than the wall time).
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
ROOMS = ("agent", "cli", "collector", "formats", "proto", "trainer", "viewer")
TOKEN = "replica-bench-token-0123"


def package_dir(tree: Path, where: Path) -> Path:
    """A directory whose `diag` package is `tree`'s folders."""
    pkg = where / "diag"
    pkg.mkdir(parents=True)
    for room in ROOMS:
        (pkg / room).symlink_to(tree / room)
    return where


def child(args: argparse.Namespace) -> None:
    """Sets one tree's node and holder up, then runs the operations named on stdin, one line
    each (`push`, `pull`), answering each with a JSON line of its seconds (wall, CPU)."""
    import multiprocessing

    import psutil

    sys.path.insert(0, str(REPO / "tests" / "support"))
    import repo

    repo.on_sys_path()
    from jobrun import free_port
    from snapshot_helpers import new_slot, write_raw_snapshot

    from diag.agent.replica.ring import Ring
    from diag.agent.replica.source import local_replica
    from diag.agent.replica.store import ReplicaStore
    from diag.agent.replica.transport import Peers, ReplicaServer, pull, push
    from diag.formats.untrusted import Owners

    job, owners, cap = "bench", Owners.this_process(), 1 << 34
    root = Path(tempfile.mkdtemp(prefix="diag-pushbench-", dir="/dev/shm"))
    try:
        run_dir = root / "a-run"
        run_dir.mkdir()
        per_rank = args.mb * 1_000_000 // 2
        for rank in (0, 1):
            slot = new_slot(run_dir, job, rank, 0, world=2)
            raw = {f"global_step5/blob{rank}.bin": os.urandom(1 << 20) * (per_rank >> 20)}
            write_raw_snapshot(slot, 5, raw, job=job, rank=rank, world=2, save_dir=root / "save",
                               node="a", run="r1")  # fmt: skip
            slot.close()
        ring = Ring.of(["a", "b"], 1)
        addrs = {"a": ("127.0.0.1", free_port()), "b": ("127.0.0.1", free_port())}

        def holder() -> None:
            store = ReplicaStore(root / "b-replicas", cap)
            ReplicaServer(store, Peers(ring, addrs, "b", job, TOKEN), addrs["b"]).start()
            time.sleep(3600)

        server = multiprocessing.get_context("fork").Process(target=holder, daemon=True)
        server.start()
        try:
            a = Peers(ring, addrs, "a", job, TOKEN)
            local = local_replica(run_dir, job, "a", owners)
            assert local is not None
            deadline = time.monotonic() + 30
            while True:  # the holder's server is up: a first push, not timed
                try:
                    assert push(a, "b", local, owners).ok
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            held = psutil.Process(server.pid)

            def cpu() -> float:
                return time.process_time() + sum(held.cpu_times()[:2])

            print(json.dumps({"bytes": local.manifest.nbytes}), flush=True)
            for n, line in enumerate(sys.stdin):
                op = line.strip()
                t0, c0 = time.perf_counter(), cpu()
                if op == "push":
                    result = push(a, "b", local, owners)
                    assert result.ok, result.error
                elif op == "pull":
                    fresh = root / f"fresh{n}"
                    pull(a, "b", fresh, max_bytes=cap)
                else:
                    break
                wall, used = time.perf_counter() - t0, cpu() - c0
                if op == "pull":
                    shutil.rmtree(fresh)
                print(json.dumps({"wall": wall, "cpu": used}), flush=True)
        finally:
            server.kill()
            server.join(10)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Tree:
    """A child running one tree's agents."""

    def __init__(self, name: str, pkgs: Path, args: argparse.Namespace) -> None:
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(pkgs), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--child", "--mb", str(args.mb)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)  # fmt: skip
        self.nbytes = int(self._answer()["bytes"])

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the bench's child ended (exit {self.proc.wait()})")
        return json.loads(line)

    def run(self, op: str) -> tuple[float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        got = self._answer()
        return float(got["wall"]), float(got["cpu"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", type=Path, help="another checkout of diag: the reference")
    ap.add_argument("--tree", type=Path, default=REPO,
                    help="the checkout measured against the reference (default: this one; the "
                    "reference again measures the bench's own noise)")  # fmt: skip
    ap.add_argument("--mb", type=int, default=384, help="the node's replica, MB (two ranks)")
    ap.add_argument("--rounds", type=int, default=30, help="timed pushes per tree")
    ap.add_argument("--pulls", type=int, default=10, help="timed pulls per tree")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.ref is None or not (args.ref / "agent" / "replica").is_dir():
        ap.error("--ref must name a checkout of diag with diag/agent/replica")
    scratch = Path(tempfile.mkdtemp(prefix="diag-pushbench-pkgs-"))
    try:
        return measure(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args: argparse.Namespace, scratch: Path) -> int:
    trees = {"reference": args.ref.resolve(), "this tree": args.tree.resolve()}
    print(f"# {args.mb} MB per replica, {args.rounds} pushes and {args.pulls} pulls per tree, "
          f"taking turns; load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}",
          flush=True)  # fmt: skip
    running = [Tree(n, package_dir(t, scratch / n.replace(" ", "-")), args) for n, t in
               trees.items()]  # fmt: skip
    got: dict[str, dict[str, list[float]]] = {
        t.name: {"push": [], "push_cpu": [], "pull": [], "pull_cpu": []} for t in running
    }
    try:
        for op, times in (("push", args.rounds), ("pull", args.pulls)):
            for i in range(times):
                for t in running if i % 2 == 0 else reversed(running):
                    wall, cpu = t.run(op)
                    got[t.name][op].append(wall)
                    got[t.name][f"{op}_cpu"].append(cpu)
            print(
                f"{op}: "
                + "; ".join(f"{n} {statistics.median(v[op]):.3f} s" for n, v in got.items()),
                flush=True,
            )
        nbytes = running[0].nbytes
    finally:
        for t in running:
            t.close()
    print(f"\n| | {' | '.join(trees)} | ratio |\n|---|---|---|---|")
    for op, what in (("push", "push, wall"), ("push_cpu", "push, CPU of both agents"),
                     ("pull", "pull, wall"), ("pull_cpu", "pull, CPU of both agents")):  # fmt: skip
        med = {n: statistics.median(got[n][op]) for n in trees}
        rate = {n: nbytes / med[n] / 1e6 for n in trees}
        ref, this = rate["reference"], rate["this tree"]
        print(f"| {what}: median MB/s (n={len(got['this tree'][op])}) | {ref:.0f} | {this:.0f} | "
              f"{this / ref:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
