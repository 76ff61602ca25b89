"""Random SIGKILLs of the trainer ranks, the agent or both during save, copy, persist and commit,
for ZeRO 1, 2 and 3, on real 2-rank DeepSpeed jobs (gloo, CPU) and a real agent (tests/support/kill/killsuite.py
does the work; tests/system/test_kill_suite.py is the short version). Prints one line per kill and the
figures: kills per stage, target and phase; torn, lost or backwards checkpoints; how far back the
restored step was from the newest step trained and from the newest step complete at the kill.

    .venv/bin/python bench/kill_bench.py --kills 210 --seed 1 --out /tmp/kills.json
    .venv/bin/python bench/kill_bench.py --replicas --kills 30   # node kills, replica in a peer

With --replicas the kills are node kills at save, copy, persist, commit and the node's push of
its replica to its holder (replicate), then one of the holder's agent as it takes the replica
(receive), in turn (--kills 36 over three stages: 2 of each per stage); the job persists to
storage every 10th step only. With --netns as well, the node (its ranks, its agent and their
replacements) runs in one network namespace and the holder's agent in another, joined by veth
links (tests/support/nodes/netlab.py, needs root): the pushes and the pull cross the links.

    .venv/bin/python bench/kill_bench.py --replicas --netns --kills 30
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
import repo  # noqa: E402  (tests/support: where every helper folder is)

repo.on_sys_path()

from faults import HOLDER_PHASES, PHASES, REPLICA_PHASES  # noqa: E402
from holderkill import kill_holder  # noqa: E402
from killsuite import TARGETS, KillResult, KillSuite  # noqa: E402
from netlab import netns_unavailable  # noqa: E402


def run_stage(
    zero: int,
    kills: int,
    rng: random.Random,
    root: Path,
    replicas: bool = False,
    netns: bool = False,
) -> list[KillResult]:
    suite = KillSuite(root / f"z{zero}", zero, log=print, replicas=replicas, netns=netns)
    out = []
    try:
        suite.start()
        for i in range(kills):
            phases = (*REPLICA_PHASES, *HOLDER_PHASES) if replicas else PHASES
            phase = phases[(i if replicas else i // len(TARGETS)) % len(phases)]
            target = TARGETS[i % len(TARGETS)]
            if replicas:
                target = "holder" if phase in HOLDER_PHASES else "node"
            mode = rng.choice(("tick", "timer"))
            if target == "holder":
                r = kill_holder(suite, phase, mode, rng.random())
            else:
                r = suite.kill(target, phase, mode, rng.random())
            out.append(r)
            print(
                f"{time.strftime('%H:%M:%S')} z{zero} #{i + 1}/{kills} {target}@{r.phase or '-'} "
                f"({r.mode}) latest={r.latest_at_kill} memory={r.memory_at_kill} "
                f"held={r.memory_by_rank} replica={r.replica_at_kill} fired_step={r.fired_step} "
                f"tick={r.fired_tick} "
                f"trained={r.trained_at_kill} "
                f"restored={r.restored}({r.source}) "
                f"committed_after={r.committed_after} replica_after={r.replica_after} "
                f"{r.seconds:.1f}s "
                + ("OK" if not r.problems else "PROBLEMS: " + "; ".join(r.problems)),
                flush=True,
            )
        leftovers = suite.leftovers()
        if leftovers:
            print(f"z{zero}: temporary files left in the save directory: {leftovers}")
    finally:
        suite.close()
    return out


def summarize(results: list[KillResult]) -> None:
    print("\n== kills per ZeRO stage x target x phase (phase = where the firing thread was)")
    by = Counter((r.zero, r.target, r.phase or "-") for r in results)
    for key in sorted(by):
        print(f"  ZeRO-{key[0]} {key[1]:8s} {key[2]:8s} {by[key]}")
    print("== totals")
    print(f"  kills: {len(results)}")
    for name, key in (("stage", "zero"), ("target", "target"), ("phase", "phase")):
        c = Counter(getattr(r, key) for r in results)
        print(f"  by {name}: " + ", ".join(f"{k}={v}" for k, v in sorted(c.items())))
    bad = [r for r in results if r.problems]
    print(f"  kills with a problem (torn, lost, backwards, differing restore): {len(bad)}")
    for r in bad:
        print(f"    ZeRO-{r.zero} {r.target}@{r.phase}: {'; '.join(r.problems)}")
    restores = [r for r in results if r.restored is not None]
    if restores:
        behind_bound = [(r.bound or 0) - (r.restored or 0) for r in restores]
        lost = [r.trained_at_kill - (r.restored or 0) for r in restores]
        src = Counter(r.source for r in restores)
        print(f"  trainer restarts: {len(restores)} (" + ", ".join(
            f"{k or 'none'}={v}" for k, v in sorted(src.items())) + ")")  # fmt: skip
        print(
            "  restored step minus newest complete at the kill: "
            f"min {-max(behind_bound)} max {-min(behind_bound)} "
            f"(0 = the newest complete step; negative would be a loss)"
        )
        print(
            "  steps trained again (newest trained - restored): "
            f"median {statistics.median(lost)} max {max(lost)} "
            f"distribution {dict(sorted(Counter(lost).items()))}"
        )
    if any(r.memory_lost or r.target == "holder" for r in results):
        summarize_replicas(results)
    secs = [r.seconds for r in results]
    if secs:
        print(f"  seconds per kill cycle: median {statistics.median(secs):.1f} max {max(secs):.1f}")


def summarize_replicas(all_results: list[KillResult]) -> None:
    """Node kills: per ZeRO stage x phase, where the restore came from, and how it stood against
    the replica the holder held whole, the newest step in the node's memory, and storage."""
    print("== node kills: stage x phase (planned), restored from, restored minus replica held / "
          "newest in memory / storage's latest")  # fmt: skip
    results = [r for r in all_results if r.memory_lost]
    groups: dict[tuple[int, str], list[KillResult]] = {}
    for r in results:
        groups.setdefault((r.zero, r.planned), []).append(r)
    for (zero, phase), rs in sorted(groups.items()):
        src = Counter(r.source or "none" for r in rs)
        vs_storage = [
            None if r.restored is None else r.restored - (r.latest_at_kill or 0) for r in rs
        ]
        print(
            f"  ZeRO-{zero} {phase:9s} kills={len(rs)} fired in "
            f"{','.join(r.phase or '-' for r in rs)} from "
            + ",".join(f"{k}={v}" for k, v in sorted(src.items()))
            + f" -replica {[r.restored_minus_replica for r in rs]}"
            f" -memory {[r.restored_minus_memory for r in rs]}"
            f" -latest {vs_storage}"
        )
    pushes = [r for r in results if r.phase == "replicate"]
    cut = [r for r in pushes if r.replica_at_kill is not None and r.replica_at_kill < r.fired_step]
    print(
        f"  kills in a push: {len(pushes)}; the push cut, the holder's previous replica kept and "
        f"restored: {sum(r.restored == r.replica_at_kill for r in cut)} of {len(cut)}; the push "
        f"complete at the holder despite the kill: {len(pushes) - len(cut)}"
    )
    lags = Counter(r.restored_minus_memory for r in results)
    print(f"  restored minus newest in memory, all: {dict(sorted(lags.items(), key=str))}")
    holders = [r for r in all_results if r.target == "holder"]
    for r in holders:
        print(
            f"  holder kill ZeRO-{r.zero} in {r.phase or '-'} ({r.mode}) of step {r.fired_step}: "
            f"whole replica left {r.replica_at_kill}, taken after the restart {r.replica_after}"
        )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=210, help="in all, split over the stages")
    p.add_argument("--zero", default="1,2,3")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="write every kill's record here (JSON)")
    p.add_argument(
        "--replicas",
        action="store_true",
        help="node kills only, with a second agent holding the node's replica (agent.replica)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="with --replicas: the node and the holder in two network namespaces (needs root)",
    )
    args = p.parse_args()
    if args.netns:
        if not args.replicas:
            p.error("--netns needs --replicas (it puts the node and its holder apart)")
        if reason := netns_unavailable():
            print(f"kill_bench: --netns: {reason}", file=sys.stderr)
            return 2
    stages = [int(z) for z in args.zero.split(",")]
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="diag-kill-bench-"))
    t0 = time.monotonic()
    results: list[KillResult] = []
    ok = False
    try:
        for i, zero in enumerate(stages):
            n = args.kills // len(stages) + (1 if i < args.kills % len(stages) else 0)
            results += run_stage(zero, n, rng, root, args.replicas, args.netns)
        ok = not any(r.problems for r in results)
    finally:
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"logs and checkpoints kept in {root}")
        summarize(results)
        print(f"  wall time: {time.monotonic() - t0:.0f} s")
        if args.out:
            Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
