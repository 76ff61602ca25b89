"""Job verdict at 2,000 and 16,000 nodes' worth of agents, against the old peer board, in one run.

Agents are simulated against a real directory (default: a fresh one under /dev/shm, or --dir,
e.g. an NFS mount) by `--workers` processes, each playing a slice of the nodes on its schedule
with the agent's own code (`joblink.look`, `jobincident.filing`, `JobVerdictStore`): every file
operation is a real one, and every node's traffic runs while the verdict is being reached.

- old board (derived): every agent rewrote its board file every 2 s (`--board-payload` bytes, a
  node of 8 ranks), and on an incident every agent read every other agent's file. Writes per
  second are N / 2 and the incident's reads N (N - 1) by that design; the time of one board
  read is measured for `--sample` agents reading all N - 1 files.
- job verdict, steady state: the agent has no code that touches the directory between
  incidents; the count is 0 by construction (nothing to simulate).
- job verdict, (a) a normal incident: every node reaches its local verdict within `--spread`
  seconds (their hang limits run out together; each agent looks every `--interval`); one of
  them, at a random place in that order, blames its own rank (first-hand) and files at once;
  the others look once at their verdict, and those that found nothing look again `view_after`
  (1 s) later. Counted: writes, reads, listings, checks, bytes; timed: the first local
  verdict to the job verdict in place.
- job verdict, (b) the fallback: no node blames its own rank (the culprit's node saw nothing);
  every node files its report with its view (8 ranks, all inside one all-reduce but rank 7 on
  node 0, which never joined) `view_after` (1 s) after its verdict, and the claimant reads them
  as they come and, once they hold every rank, runs the culprit analysis and puts the verdict
  in place (`fallback.py`; with a view missing, at the end of the settle time since it filed
  its own). Counted and timed the same way.

    python bench/jobverdict_bench.py [--nodes 2000,16000] [--dir PATH] [--workers 2]
"""

from __future__ import annotations

import argparse
import heapq
import multiprocessing as mp
import os
import random
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.job.decisions import Filing, Mine, NodeReport, Where, filing
from diag.agent.job.link import look
from diag.agent.job.nodeview import view_document
from diag.agent.job.verdict import IOCount, JobVerdict, JobVerdictStore
from diag.formats.journalmeta import write_atomic
from diag.formats.records import OpCode, OpState

JOB = "job"
INCIDENT = "a0-hang-pg0-seq42"
PER_NODE = 8


def board(root: Path, n: int, payload: int, sample: int) -> dict[str, float]:
    d = root / "peers" / "job"
    d.mkdir(parents=True)
    data = b"x" * payload
    for i in range(n):  # one publication round: what the job wrote every 2 s
        write_atomic(d / f"node-{i}.json", data)
    t0 = time.perf_counter()
    for a in range(sample):  # agents reading the whole board, as each did on an incident
        for i in range(n):
            if i != a:
                (d / f"node-{i}.json").read_bytes()
    return {
        "steady_writes_per_s": n / 2.0,
        "steady_bytes_per_s": n * payload / 2.0,
        "incident_writes": float(n),
        "incident_reads": float(n * (n - 1)),
        "incident_bytes_read": float(n * (n - 1) * payload),
        "verdict_after_s": (time.perf_counter() - t0) / sample,
    }


def _node_view(node: int, n: int, now: float, wall: float) -> dict:
    """A node's view: its ranks wait in all-reduce #42 of the world group, except rank 7 (on
    node 0), which finished #41 and never entered #42."""
    ranks = []
    for local in range(PER_NODE):
        r = node * PER_NODE + local
        done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 1 << 20, now - 12, now - 11.9)
        stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 1 << 20, now - 10)
        behind = r == 7
        ranks.append(RankSnapshot(
            rank=r, local_rank=local, pid=1000 + local, node=f"node-{node}",
            liveness=Liveness.RUNNING, started_at=0.0, last_activity=now - (11.9 if behind else 10),
            step=7, pending=() if behind else (stuck,), last_ops={"0": done if behind else stuck},
            step_durations=(0.5,),
        ))  # fmt: skip
    obs = Observation(now=now, ranks=tuple(ranks), groups={}, world_size=n * PER_NODE, job=JOB)
    doc = view_document(obs, f"node-{node}", wall)
    # The world group, as view_document writes it (one span); written here once instead of
    # sorting 128,000 ranks for each of 16,000 simulated nodes.
    doc["groups"] = {"0": [[0, n * PER_NODE - 1]]}
    return doc


@dataclass
class Plan:
    root: str
    n: int
    fallback: bool
    culprit_node: int  # -1: none first-hand
    offsets: list[float]  # each node's local verdict, seconds after t0
    settle: float
    poll: float
    max_memory: int = 6 << 30


@dataclass
class WorkerResult:
    io: dict[str, int]
    first_look: float = float("inf")  # wall time of the earliest local verdict it played
    filed: int = 0
    verdict_at: float | None = None  # when its claimant put the verdict in place
    claimed_at: float | None = None  # when its claimant filed (and claimed)
    claimant_reads: int = 0  # reports its claimant read
    due_at: float | None = None  # the end of its claimant's settle time
    covered_at: float | None = None  # when its claimant saw the views hold every rank
    verdict: JobVerdict | None = None
    late_s: float = 0.0  # how far behind its schedule it ran, at worst
    filed_at: list[float] = field(default_factory=list)  # when each of its filings was done
    report_bytes: list[int] = field(default_factory=list)


def _worker(plan: Plan, me: int, workers: int, q_in: Any, q_out: Any) -> None:
    # Other work shares the machine: a runaway analysis fails here rather than swapping.
    resource.setrlimit(resource.RLIMIT_AS, (plan.max_memory, plan.max_memory))
    store = JobVerdictStore(Path(plan.root) / ".jobs", settle=plan.settle, poll=plan.poll)
    timeline = Path(plan.root)
    mine_nodes = [i for i in range(plan.n) if i % workers == me]
    views = {
        i: _node_view(i, plan.n, 100.0, time.time())
        for i in mine_nodes
        if plan.fallback or i == plan.culprit_node
    }
    q_out.put(("ready", me))
    t0 = q_in.get()
    res = WorkerResult(io={})
    claimant: list[threading.Thread] = []
    claimant_io: list[IOCount] = []
    events = [(t0 + plan.offsets[i], 0, i) for i in mine_nodes]  # (time, look number, node)
    heapq.heapify(events)

    def conclude(first_seen: float) -> None:
        own = JobVerdictStore(store.root, settle=plan.settle, poll=plan.poll)
        res.claimed_at = first_seen
        res.due_at = first_seen + plan.settle

        def on_verdict(v: JobVerdict) -> None:
            res.verdict_at, res.verdict = time.time(), v

        own.wait_and_conclude(JOB, INCIDENT, first_seen, on_verdict)
        res.claimant_reads = own.io.reads
        res.covered_at = own.covered_wall
        claimant_io.append(own.io)

    while events:
        at, n_look, i = heapq.heappop(events)
        time.sleep(max(0.0, at - time.time()))
        res.late_s = max(res.late_s, time.time() - at)
        decided = t0 + plan.offsets[i]
        where = Where.LOCAL if i == plan.culprit_node else Where.REMOTE
        mine = Mine(INCIDENT, where, decided, decided, since_wall=t0 - 3600)
        if n_look == 0:
            res.first_look = min(res.first_look, time.time())
        target = look(store, JOB, mine, window=2 * plan.settle, settled=n_look == 1)
        how = filing(mine, target, settled=n_look == 1)
        if how == Filing.WAIT:
            heapq.heappush(events, (decided + store.view_after, 1, i))
        if how != Filing.NOW:
            continue
        now = time.time()
        report = NodeReport(
            node=f"node-{i}", culprit=7 if where == Where.LOCAL else None, where=where,
            evidence=str(timeline / f"20261125-000000-hang-node-{i}@{JOB}-{target.incident_id}"),
            kind="hang", summary="hang: ...", wall=now, view=views.get(i), first_sign_wall=decided,
        )  # fmt: skip
        before = store.io.bytes_written
        claimed = store.file(JOB, target.incident_id, report)
        res.filed += 1
        res.filed_at.append(time.time())
        res.report_bytes.append(store.io.bytes_written - before)
        if claimed:
            t = threading.Thread(target=conclude, args=(now,))
            t.start()
            claimant.append(t)
    for t in claimant:
        t.join()
    for io in claimant_io:
        store.io.add(io)
    res.io = dict(vars(store.io))
    q_out.put(("done", res))


def scenario(
    root: Path, n: int, *, fallback: bool, workers: int, spread: float, settle: float, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    offsets = [rng.uniform(0.0, spread) for _ in range(n)]
    culprit = -1 if fallback else 0
    plan = Plan(str(root), n, fallback, culprit, offsets, settle, poll=0.5)
    ctx = mp.get_context("fork")
    q_out = ctx.Queue()
    q_ins = [ctx.Queue() for _ in range(workers)]
    procs = [
        ctx.Process(target=_worker, args=(plan, w, workers, q_ins[w], q_out))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert q_out.get(timeout=600)[0] == "ready"
    t0 = time.time() + 0.5
    for q in q_ins:
        q.put(t0)
    results: list[WorkerResult] = [q_out.get(timeout=900)[1] for _ in procs]
    for p in procs:
        p.join(60)
    verdicts = [r for r in results if r.verdict_at is not None]
    assert len(verdicts) == 1, "one claimant, one verdict"
    claimant = verdicts[0]
    v = claimant.verdict
    assert v is not None and (v.culprit, v.culprit_node) == (7, "node-0"), v
    io = {k: sum(r.io[k] for r in results) for k in results[0].io}
    sizes = [b for r in results for b in r.report_bytes]
    verdict_file = root / ".jobs" / JOB / INCIDENT / "job-verdict.json"
    at = claimant.verdict_at
    assert at is not None
    return {
        "writes": float(io["writes"]),
        "reads": float(io["reads"]),
        "listings": float(io["listings"]),
        "stats": float(io["stats"]),
        "bytes_written": float(io["bytes_written"]),
        "bytes_read": float(io["bytes_read"]),
        "filed": float(sum(r.filed for r in results)),
        "report_bytes": sum(sizes) / len(sizes),
        "verdict_bytes": float(verdict_file.stat().st_size),
        "verdict_after_s": verdicts[0].verdict_at - min(r.first_look for r in results),  # type: ignore[operator]
        # (a): from the culprit's node's own verdict; (b): from the first filing's
        "verdict_after_culprit_s": verdicts[0].verdict_at - (t0 + offsets[0]),  # type: ignore[operator]
        "late_s": max(r.late_s for r in results),
        "claimant_reads": float(claimant.claimant_reads),
        # (b): from when the claimant saw the views hold every rank to the job verdict (the
        # analysis, the quiet time); nan when a view was still missing at the settle time
        "conclude_s": claimant.verdict_at - claimant.covered_at  # type: ignore[operator]
        if claimant.covered_at is not None
        else float("nan"),
        "first_to_covered_s": claimant.covered_at - min(r.first_look for r in results)
        if claimant.covered_at is not None
        else float("nan"),
        # (b): from the last view filed (by the nodes that filed before the verdict) to the job
        # verdict: the claimant's own part, whatever the simulation's delay in filing
        "last_filed_to_verdict_s": at - max(t for r in results for t in r.filed_at if t <= at),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2000,16000")
    ap.add_argument(
        "--dir", type=Path, default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    )
    ap.add_argument("--workers", type=int, default=2, help="processes playing the nodes")
    ap.add_argument("--spread", type=float, default=0.5, help="local verdicts within, seconds")
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument(
        "--fallback-settle",
        type=float,
        default=None,
        help="settle time of the fallback scenario (default --settle): longer when this machine "
        "cannot play every node's filing within the settle time, so that every view is read",
    )
    ap.add_argument("--board-payload", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=3, help="agents that read the whole old board")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    for n in (int(x) for x in args.nodes.split(",")):
        root = Path(tempfile.mkdtemp(prefix="jv-bench-", dir=args.dir))
        try:
            old = board(root / "old", n, args.board_payload, args.sample)
            runs = {
                name: scenario(
                    root / name,
                    n,
                    fallback=name == "fallback",
                    workers=args.workers,
                    spread=args.spread,
                    settle=(args.fallback_settle or args.settle)
                    if name == "fallback"
                    else args.settle,
                    seed=args.seed,
                )
                for name in ("normal", "fallback")
            }
        finally:
            shutil.rmtree(root, ignore_errors=True)
        _print(n, args, old, runs)


def _print(n: int, args: argparse.Namespace, old: dict, runs: dict[str, dict]) -> None:
    a, b = runs["normal"], runs["fallback"]
    print(f"\n== {n} nodes (directory {args.dir or tempfile.gettempdir()}, "
          f"{args.workers} worker processes, verdicts within {args.spread} s, "
          f"settle {args.settle} s, fallback {args.fallback_settle or args.settle} s) ==")  # fmt: skip
    print(f"{'':38}{'old board':>14}{'(a) normal':>14}{'(b) fallback':>14}")
    rows = [
        ("steady state: writes/s", old["steady_writes_per_s"], 0.0, 0.0),
        ("steady state: bytes written/s", old["steady_bytes_per_s"], 0.0, 0.0),
        ("incident: writes (job-wide)", old["incident_writes"], a["writes"], b["writes"]),
        ("incident: reports filed", old["incident_writes"], a["filed"], b["filed"]),
        ("incident: file reads", old["incident_reads"], a["reads"], b["reads"]),
        ("incident: listings", float("nan"), a["listings"], b["listings"]),
        ("incident: existence/time checks", float("nan"), a["stats"], b["stats"]),
        ("incident: bytes written", float("nan"), a["bytes_written"], b["bytes_written"]),
        ("incident: bytes read", old["incident_bytes_read"], a["bytes_read"], b["bytes_read"]),
        ("first local verdict -> job verdict, s", old["verdict_after_s"], a["verdict_after_s"],
         b["verdict_after_s"]),
        ("node 0's local verdict -> job verdict, s", float("nan"),
         a["verdict_after_culprit_s"], b["verdict_after_culprit_s"]),
    ]  # fmt: skip
    for label, o, x, y in rows:
        print(f"{label:38}{_num(o):>14}{_num(x):>14}{_num(y):>14}")
    print(
        f"  report {a['report_bytes'] / 1024:.1f} KiB (a), {b['report_bytes'] / 1024:.1f} KiB "
        f"(b); job verdict file {a['verdict_bytes']:.0f} B (a), {b['verdict_bytes']:.0f} B (b); "
        f"the simulation ran up to {a['late_s']:.2f} s (a) / {b['late_s']:.2f} s (b) behind "
        f"its schedule; (b) claimant read {b['claimant_reads']:.0f} reports, saw them hold "
        f"every rank {b['first_to_covered_s']:.2f} s after the first local verdict, and "
        f"concluded {b['conclude_s']:.2f} s after that (nan: a view was still missing at the "
        f"end of its settle time); the last view filed before the verdict came "
        f"{b['last_filed_to_verdict_s']:.2f} s before it"
    )


def _num(x: float) -> str:
    if x != x:  # nan: not a figure of that scheme
        return "-"
    return f"{x:,.0f}" if x == int(x) else f"{x:.4g}"


if __name__ == "__main__":
    main()
