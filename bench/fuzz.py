"""Long fuzz runs of every parser of outside data: `python bench/fuzz.py --inputs 100000`.

Prints, per parser, the inputs tried, how many were accepted and refused, crashes and hangs (each
with the input that caused it, saved under --findings), the slowest input and the growth of the
process's peak RSS. Exits 1 when any parser crashed or hung.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))
import repo  # noqa: E402  (tests/support: where every helper folder is)

repo.on_sys_path()

from fuzzkit import all_targets, run_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs per parser")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="substring of the parser names to run")
    ap.add_argument("--findings", type=Path, default=Path("fuzz-findings"))
    args = ap.parse_args()
    if args.inputs < 1:
        ap.error("--inputs must be at least 1")
    targets = [t for t in all_targets() if args.only in t.name]
    if not targets:
        ap.error(f"no parser matches {args.only!r}")
    print(
        f"# {len(targets)} parsers, {args.inputs} inputs each, seed {args.seed}, "
        f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(
        f"{'parser':<34} {'inputs':>8} {'accepted':>9} {'refused':>9} {'crash':>6} {'hang':>5} "
        f"{'slowest_ms':>10} {'rss+MB':>7} {'secs':>7}"
    )
    bad = 0
    scratch_root = Path(tempfile.mkdtemp(prefix="diag-fuzz-"))
    try:
        for i, target in enumerate(targets):
            scratch = scratch_root / f"t{i}"

            def progress(n: int, name: str = target.name) -> None:
                print(f"  {name}: {n}/{args.inputs}", file=sys.stderr, flush=True)

            r = run_target(target, scratch, inputs=args.inputs, seed=args.seed, progress=progress)
            crashes = sum(f.kind == "crash" for f in r.findings)
            hangs = sum(f.kind == "hang" for f in r.findings)
            print(
                f"{r.target:<34} {r.inputs:>8} {r.accepted:>9} {r.refused:>9} {crashes:>6} "
                f"{hangs:>5} {r.slowest_s * 1e3:>10.1f} {r.rss_growth_mb:>7.1f} {r.seconds:>7.1f}",
                flush=True,
            )
            if r.findings:
                bad += 1
                out = args.findings / target.name.replace(" ", "_")
                out.mkdir(parents=True, exist_ok=True)
                for j, f in enumerate(r.findings):
                    (out / f"{j:02d}-{f.kind}.bin").write_bytes(f.data)
                    (out / f"{j:02d}-{f.kind}.txt").write_text(f.detail)
                print(f"  findings saved under {out}", flush=True)
    finally:
        shutil.rmtree(scratch_root, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
