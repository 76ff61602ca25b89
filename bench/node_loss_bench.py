"""Whole-node losses of a job across nodes at 0.2 s steps, in a loop: two nodes on this machine
(a run directory each, a real `diag agent` with `--replica-nodes` and a torchrun of one ZeRO-2
rank each; tests/support/nodes/twonodes.py), storage every 20 steps. Each loss SIGKILLs node b (its
rank, torchrun and agent) at a random step storage does not hold, wipes its shared memory,
starts its agent again empty (it pulls its replica from node a) and restarts the job on both
nodes. Prints one line per loss and the figures: where the job resumed from, its step against
the replica node a held and the newest step trained at the loss.

    .venv/bin/python bench/node_loss_bench.py --losses 50 --seed 1 --out /tmp/losses.json
    .venv/bin/python bench/node_loss_bench.py --losses 5 --hidden 512 --max-rate 4MB  # pushes of seconds

(`--max-rate` alone does not slow the default model's pushes: its snapshot, tens of KB, fits in
the pace's burst of at least 4 MiB many times over.)

tests/system/test_node_loss.py is one loss of it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
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

from twonodes import PERSIST_EVERY, Loss, TwoNodes, lose_and_restart, start_job  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--losses", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="write every loss's record here (JSON)")
    p.add_argument(
        "--max-rate", default="",
        help="--replica-max-rate of the agents, e.g. 4MB (with --hidden 512: pushes longer than a step)",
    )  # fmt: skip
    p.add_argument("--hidden", type=int, default=0, help="the model's width (elastic_job.py)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="diag-bench-nodeloss-"))
    c = TwoNodes(
        root,
        ("--replica-max-rate", args.max_rate) if args.max_rate else (),
        ("--hidden", str(args.hidden)) if args.hidden else (),
    )
    losses: list[Loss] = []
    t0 = time.monotonic()
    try:
        start_job(c, "run0")
        for i in range(args.losses):
            past = rng.randrange(1, PERSIST_EVERY)
            loss = lose_and_restart(c, f"run{i}", f"run{i + 1}", past)
            losses.append(loss)
            lag = None if loss.held is None else loss.newest - loss.held
            print(f"loss {i + 1}: newest trained {loss.newest}, replica held {loss.held}, "
                  f"storage {loss.storage}; resumed from {loss.start['from']} at step "
                  f"{loss.start['step']} (newest minus replica: {lag})", flush=True)  # fmt: skip
    finally:
        c.close()
        shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - t0
    at_replica = sum(x.start["from"] == "memory" and x.start["step"] == x.held for x in losses)
    sources = Counter(str(x.start["from"]) for x in losses)
    lags = Counter(x.newest - x.held for x in losses if x.held is not None)
    print(f"\n{len(losses)} losses in {wall:.0f} s")
    print(f"resumed at the replica's step from memory: {at_replica} of {len(losses)}")
    print(f"resumed from: {dict(sources)}")
    print(f"newest trained minus replica held: {dict(sorted(lags.items()))}")
    print(f"pulled by the new agent: {sum(x.pulled for x in losses)} of {len(losses)}")
    print(f"fallbacks logged by rank 0: {sum(x.fell_back_logged for x in losses)}")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(x) for x in losses], indent=1))
    return 0 if at_replica == len(losses) else 1


if __name__ == "__main__":
    sys.exit(main())
