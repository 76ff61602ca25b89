"""Writes a production-shaped incident (see bench/incidentgen/): the dumps of every rank in one
of the formats `diag merge` reads, and `truth.json` saying what was injected.

    .venv/bin/python bench/incident_gen.py OUT --ranks 1344 [--format xpu] [--scenario odd]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from incidentgen import FORMATS, SCENARIOS, iter_sizes, plan_incident, write_incident


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write the dumps into")
    ap.add_argument("--ranks", type=int, default=1344)
    ap.add_argument("--local", type=int, default=8, help="ranks per node")
    ap.add_argument("--format", choices=FORMATS, default="diag")
    ap.add_argument("--scenario", choices=SCENARIOS, default="odd")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--odd", type=int, default=1, help="odd ranks (scenario odd)")
    ap.add_argument("--missing-nodes", type=int, default=1)
    ap.add_argument("--missing-ranks", type=int, default=2)
    ap.add_argument("--corrupt", type=int, default=2)
    ap.add_argument("--timed-out", type=int, default=1)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    try:
        truth = plan_incident(
            args.ranks,
            local=args.local,
            scenario=args.scenario,
            fmt=args.format,
            seed=args.seed,
            odd=args.odd,
            missing_nodes=args.missing_nodes,
            missing_ranks=args.missing_ranks,
            corrupt=args.corrupt,
            timed_out=args.timed_out,
        )
    except ValueError as e:
        print(f"incident_gen: {e}", file=sys.stderr)
        return 2
    done = write_incident(args.out, truth, args.workers)
    size = sum(iter_sizes(args.out))
    print(json.dumps({**asdict(done), "bytes": size}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
