"""Job verdict against the old peer board, at 2,000 and 16,000 nodes' worth of agents, in one run.

Agents are simulated in-process against a real directory (default: a fresh one under /dev/shm or
--dir, e.g. an NFS mount), one file operation per real agent's file operation:

- old board: every agent rewrites its board file every 2 s (`--board-payload` bytes, ~ a node of
  8 ranks), and on an incident every agent reads every other agent's file. Steady-state writes
  are N / 2 per second; the incident's reads are measured for a sample of agents reading all N-1
  files and scaled to N agents (counts are exact, time is per agent).
- job verdict: nothing in steady state; on an incident every agent files one report (real
  writes, all N), one claims it (O_EXCL), and the claimant lists the reports and reads the
  culprit node's. Time from the first local verdict to the job verdict is measured with the
  claimant's real polling thread, the culprit's node reporting first (a death it saw) and the
  others after it.
- job verdict, fallback: no node blames one of its own ranks (the culprit's node saw nothing
  wrong), so after the settle time the claimant reads every report once and runs the culprit
  analysis over all their views (8 ranks per node, every rank but one inside the same
  all-reduce). Reads, bytes and the time of that one conclusion are measured.

    python bench/jobverdict_bench.py [--nodes 2000,16000] [--dir PATH] [--fallback-only]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from diag.agent.jobverdict import JobVerdictStore, NodeReport, Where
from diag.agent.nodeview import view_document
from diag.agent.observation import Liveness, Observation, OpView, RankSnapshot
from diag.collector.meta import write_atomic
from diag.collector.records import OpCode, OpState


def board(root: Path, n: int, payload: int, sample: int) -> dict[str, float]:
    d = root / "peers" / "job"
    d.mkdir(parents=True)
    data = b"x" * payload
    t0 = time.perf_counter()
    for i in range(n):  # one publication round: what the job writes every 2 s
        write_atomic(d / f"node-{i}.json", data)
    round_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in range(sample):  # agents reading the whole board, as each does on an incident
        for i in range(n):
            if i != a:
                (d / f"node-{i}.json").read_bytes()
    per_agent_read_s = (time.perf_counter() - t0) / sample
    return {
        "steady_writes_per_s": n / 2.0,
        "steady_bytes_per_s": n * payload / 2.0,
        "incident_reads": float(n * (n - 1)),
        "incident_bytes_read": float(n * (n - 1) * payload),
        "incident_writes": float(n),  # each agent publishes at once (force) on its verdict
        "verdict_after_s": per_agent_read_s,  # each agent, after its own read of the board
        "one_round_write_s": round_s,
    }


def jobverdict(root: Path, n: int) -> dict[str, float]:
    store = JobVerdictStore(root / ".jobs", settle=120.0, poll=0.5)
    tl = root
    culprit = NodeReport("node-0", 7, Where.LOCAL, str(tl / "20261124-000000-hang-node-0"))
    t_first = time.time()
    t0 = time.perf_counter()
    assert store.file("job", "a0-hang-g0-1", culprit)
    box: list[float] = []

    def claimant() -> None:
        store.wait_and_conclude("job", "a0-hang-g0-1", t_first)

    th = threading.Thread(target=claimant, daemon=True)
    th.start()
    while store.load("job", "a0-hang-g0-1") is None:
        time.sleep(0.005)
    box.append(time.perf_counter() - t0)
    others = JobVerdictStore(root / ".jobs")
    t1 = time.perf_counter()
    for i in range(1, n):
        r = NodeReport(f"node-{i}", 7, Where.REMOTE, str(tl / f"20261124-000000-hang-node-{i}"))
        others.file("job", "a0-hang-g0-1", r)
    filing_s = time.perf_counter() - t1
    # The late reports' evidence, added by the claimant at the end of its settle time.
    t2 = time.perf_counter()
    v = store.load("job", "a0-hang-g0-1")
    assert v is not None
    full = store.add_late_reports("job", "a0-hang-g0-1", v)
    add_s = time.perf_counter() - t2
    assert len(full.nodes) == n and full.culprit == 7 and full.culprit_node == "node-0"
    size = (store.incident_dir("job", "a0-hang-g0-1") / "job-verdict.json").stat().st_size
    writes = store.io.writes + others.io.writes
    return {
        "steady_writes_per_s": 0.0,
        "steady_bytes_per_s": 0.0,
        "incident_reads": float(store.io.reads + store.io.listings),
        "incident_listings": float(store.io.listings),
        "incident_bytes_read": float(store.io.bytes_read),
        "incident_writes": float(writes),
        "incident_bytes_written": float(store.io.bytes_written + others.io.bytes_written),
        "verdict_after_s": box[0],
        "filing_all_s": filing_s,
        "add_late_s": add_s,
        "job_verdict_bytes": float(size),
    }


def _node_view(node: int, n: int, per_node: int, now: float, wall: float) -> dict:
    """A node's view: its ranks wait in all-reduce #42 of the world group, except rank 7 (on
    node 0), which finished #41 and never entered #42."""
    ranks = []
    for local in range(per_node):
        r = node * per_node + local
        done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 1 << 20, now - 12, now - 11.9)
        stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 1 << 20, now - 10)
        behind = r == 7
        ranks.append(RankSnapshot(
            rank=r, local_rank=local, pid=1000 + local, node=f"node-{node}",
            liveness=Liveness.RUNNING, started_at=0.0, last_activity=now - (11.9 if behind else 10),
            step=7, pending=() if behind else (stuck,), last_ops={"0": done if behind else stuck},
            step_durations=(0.5,),
        ))  # fmt: skip
    obs = Observation(now=now, ranks=tuple(ranks), groups={}, world_size=n * per_node, job="job")
    doc = view_document(obs, f"node-{node}", wall)
    # The world group, as view_document writes it (one span); written here once instead of
    # sorting 128,000 ranks for each of 16,000 simulated nodes.
    doc["groups"] = {"0": [[0, n * per_node - 1]]}
    return doc


def fallback(root: Path, n: int, per_node: int = 8) -> dict[str, float]:
    store = JobVerdictStore(root / ".jobs", settle=10.0)
    wall = time.time()
    written = 0
    for i in range(n):
        r = NodeReport(
            f"node-{i}", None, Where.REMOTE, str(root / f"20261124-000000-hang-node-{i}"),
            view=_node_view(i, n, per_node, 100.0, wall),
        )  # fmt: skip
        store.file("job", "a0-hang-g0-42", r)
        written = store.io.bytes_written
    reads0, bytes0 = store.io.reads, store.io.bytes_read
    t0 = time.perf_counter()
    v = store.conclude("job", "a0-hang-g0-42", first_seen=wall, now_wall=wall + 10, force=True)
    took = time.perf_counter() - t0
    assert v is not None and (v.culprit, v.culprit_node) == (7, "node-0"), v
    return {
        "reads": float(store.io.reads - reads0),
        "bytes_read": float(store.io.bytes_read - bytes0),
        "report_bytes": written / n,
        "conclude_s": took,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2000,16000")
    ap.add_argument(
        "--dir", type=Path, default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    )
    ap.add_argument("--board-payload", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=3, help="agents that read the whole old board")
    ap.add_argument("--fallback-only", action="store_true", help="only the fallback scenario")
    args = ap.parse_args()
    for n in (int(x) for x in args.nodes.split(",")):
        root = Path(tempfile.mkdtemp(prefix="jv-bench-", dir=args.dir))
        try:
            if not args.fallback_only:
                _compare(n, root, args)
            fb = fallback(root / "fallback", n)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"  {n} nodes, fallback (no first-hand report): {fb['reads']:.0f} reports read, "
            f"{fb['bytes_read'] / 1e6:.1f} MB ({fb['report_bytes'] / 1024:.1f} KiB each), culprit "
            f"named in {fb['conclude_s']:.2f} s after the settle time"
        )


def _compare(n: int, root: Path, args: argparse.Namespace) -> None:
    old = board(root / "old", n, args.board_payload, args.sample)
    new = jobverdict(root / "new", n)
    print(f"\n== {n} nodes (directory {args.dir or tempfile.gettempdir()}) ==")
    print(f"{'':34}{'old board':>16}{'job verdict':>16}{'old/new':>10}")
    for key, label in [
        ("steady_writes_per_s", "steady state: writes/s"),
        ("steady_bytes_per_s", "steady state: bytes written/s"),
        ("incident_writes", "incident: writes (job-wide)"),
        ("incident_reads", "incident: reads (job-wide)"),
        ("incident_bytes_read", "incident: bytes read (job-wide)"),
        ("verdict_after_s", "first local -> job verdict, s"),
    ]:
        o, w = old[key], new[key]
        ratio = f"{o / w:.0f}x" if w else "inf"
        print(f"{label:34}{o:>16.4g}{w:>16.4g}{ratio:>10}")
    print(
        f"  job verdict: {new['incident_listings']:.0f} listings, "
        f"{new['job_verdict_bytes'] / 1024:.0f} KiB verdict, all {n} reports filed in "
        f"{new['filing_all_s']:.2f} s (one agent doing them in turn), late evidence added in "
        f"{new['add_late_s']:.3f} s; old board: one publication round "
        f"{old['one_round_write_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
