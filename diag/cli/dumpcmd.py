"""`diag dump`: the same evidence the agent captures on a hang, on demand.

diag dump                      every rank journaled in the run directory
diag dump --pid 4242 --pid 4243  these processes (rank and world size from their environment)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
from pathlib import Path

from diag.agent.config.options import DEFAULT_TIMELINE
from diag.agent.evidence.collection import EvidenceTarget, capture, verdict_document
from diag.agent.evidence.pyspy import DumpTarget, can_trace
from diag.agent.observe.observer import Observer
from diag.agent.optiontable.optiontable import bounded_type, positive
from diag.formats import exitcodes
from diag.formats.rundir import default_run_dir, node_name
from diag.formats.untrusted import printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pid",
        type=int,
        action="append",
        default=[],
        help="dump this process (repeatable); default: all journaled ranks",
    )
    parser.add_argument("--run-dir", type=Path, help="journal directory [env DIAG_RUN_DIR]")
    parser.add_argument(
        "--timeline",
        type=Path,
        help=f"where to write [env DIAG_TIMELINE; default {DEFAULT_TIMELINE}]",
    )
    parser.add_argument("--job", help="only ranks of this job")
    parser.add_argument("--no-native", action="store_true", help="Python frames only (faster)")
    parser.add_argument(
        "--pyspy-timeout",
        type=bounded_type(0, 600, positive, lo_open=True),
        default=10.0,
        help="seconds allowed for each rank's stack dump, as the agent's option (default 10; a "
        "native dump loads the libraries' symbols, which takes longer on a busy node)",
    )
    parser.add_argument("--reason", default="manual dump", help="recorded in verdict.json")


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _pid_targets(pids: list[int]) -> list[EvidenceTarget]:
    targets = []
    for i, pid in enumerate(pids):
        if not Path(f"/proc/{pid}").exists():
            raise exitcodes.UsageError(f"--pid {pid}: no such process")
        env = _environ(pid)
        world = int(env.get("WORLD_SIZE", len(pids)) or len(pids))
        rank = int(env.get("RANK", i) or i)
        local = int(env.get("LOCAL_RANK", -1) or -1)
        targets.append(EvidenceTarget(DumpTarget(rank, world, pid, local, node_name())))
    ranks = [t.dump.rank for t in targets]
    if len(set(ranks)) != len(ranks):
        raise exitcodes.UsageError(
            f"processes {pids} report duplicate ranks {ranks}; dump ranks of one job at a time"
        )
    return targets


def _journal_targets(run_dir: Path, job: str | None) -> list[EvidenceTarget]:
    """Ranks whose process is shown to be their journal's writer (rankproof.py)."""
    obs = Observer(run_dir, job)
    try:
        obs.discover()
        return [
            EvidenceTarget(
                DumpTarget(
                    t.meta.rank, t.meta.world_size, t.meta.pid, t.meta.local_rank, t.meta.node
                ),
                journal=t.path,
                owners=obs.owners,
            )
            for t in sorted(obs.current(), key=lambda t: t.rank)
            if obs.proof(t)
        ]
    finally:
        obs.close()


def run(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or default_run_dir()
    timeline = args.timeline or Path(os.environ.get("DIAG_TIMELINE", DEFAULT_TIMELINE))
    if args.pid:
        targets = _pid_targets(args.pid)
    else:
        targets = _journal_targets(run_dir, args.job)
        if not targets:
            raise exitcodes.UsageError(
                f"no live journaled ranks in {run_dir}; pass --pid, or --run-dir/DIAG_RUN_DIR "
                "pointing at the trainer's run directory"
            )
    if not can_trace():
        raise exitcodes.UsageError(
            "no permission to trace other processes: run as root or grant CAP_SYS_PTRACE"
        )
    now = dt.datetime.now(dt.UTC)
    node = node_name()
    world = max(t.dump.world_size for t in targets)
    doc = verdict_document(
        None, kind="manual", incident_id=f"manual-{node}-{now.strftime('%Y%m%dT%H%M%S')}",
        job=args.job or "", node=node, world_size=world, detected_at=now, summary=args.reason,
    )  # fmt: skip
    try:
        result = capture(
            targets, timeline, doc, native=not args.no_native, pyspy_timeout=args.pyspy_timeout
        )
    except OSError as e:
        raise exitcodes.UsageError(f"cannot write to {timeline}: {e.strerror}") from e
    failed = [d for d in result.dumps if d.error]
    print(printable(f"{result.path}  ({len(result.dumps)} ranks, {result.total_seconds:.2f} s)"))
    for d in failed:  # py-spy's error text comes from the process: no terminal escapes
        print(printable(f"  rank {d.rank} (pid {d.pid}): {d.error}", keep_newlines=False))
    return exitcodes.OK if len(failed) < len(result.dumps) else exitcodes.FAILURE
