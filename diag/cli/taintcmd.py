"""`diag taint`: gather this node's evidence, plan its taint, and apply it (or print it with
`--dry-run`). Runs where the agent runs, with the agent's service account; an admin can run it
with a kubeconfig for any node."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from diag.agent.config.options import DEFAULT_TIMELINE
from diag.agent.optiontable.optiontable import bounded_type
from diag.agent.taint import evidencesources as taintevidence
from diag.agent.taint import gpuhealth, taintconfig
from diag.agent.taint.flow import TaintOutcome, taint
from diag.agent.taint.kube import KubeError
from diag.agent.taint.ledger import LedgerBusy
from diag.agent.taint.planner import Evidence, Signal
from diag.formats import exitcodes
from diag.formats.exitcodes import UsageError


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node", help="the Kubernetes node (default: $NODE_NAME, from the downward API)"
    )
    parser.add_argument("--job", help="the training job (default: $DIAG_JOB)")
    parser.add_argument(
        "--timeline",
        type=Path,
        help=f"the shared timeline path (default: $DIAG_TIMELINE, else {DEFAULT_TIMELINE})",
    )
    parser.add_argument("--config", type=Path, help="TOML file with a [taint] table")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument(
        "--precheck-report", type=Path, help="a `diag precheck --report` file: its verdict"
    )
    parser.add_argument(
        "--iface", action="append", default=[], help="check this NIC's carrier (repeatable)"
    )
    parser.add_argument(
        "--no-gpu-probe", action="store_true", help="do not read ECC/XIDs from NVML"
    )
    parser.add_argument(
        "--gpu-watch",
        type=bounded_type(0, 3600),
        default=0.0,
        metavar="SECONDS",
        help="listen this long for XID events (NVML reports XIDs as they happen, not those "
        "raised before; the agent's --taint-gpu-watch listens all along). Default 0: ECC only",
    )
    parser.add_argument(
        "--xid",
        action="append",
        default=[],
        metavar="CODE[@GPU]",
        help="a GPU XID seen by another watcher (repeatable)",
    )
    parser.add_argument(
        "--ecc",
        action="append",
        default=[],
        metavar="COUNT[@GPU]",
        help="uncorrected ECC errors seen by another watcher (repeatable)",
    )
    parser.add_argument("--incident-id", default="", help="incident id for --xid/--ecc")
    parser.add_argument("--incident-path", default="", help="where their evidence lies")
    taintconfig.add_arguments(parser, agent=False)


def resolve_node(args: argparse.Namespace) -> str:
    node = args.node or os.environ.get("NODE_NAME") or os.environ.get("DIAG_NODE")
    if not node:
        raise UsageError(
            "which node? pass --node or set NODE_NAME (in a pod: valueFrom fieldRef "
            "spec.nodeName); the hostname of a pod is not its node's name"
        )
    return node


def timeline_problem(timeline: Path, e: Exception) -> str:
    return (
        f"cannot use the timeline {timeline} (incidents and the job's taint ledger): {e}. "
        "Set --timeline or DIAG_TIMELINE to the shared timeline volume, writable by this user"
    )


def resolve_timeline(args: argparse.Namespace) -> Path:
    return args.timeline or Path(os.environ.get("DIAG_TIMELINE", DEFAULT_TIMELINE))


def _code_at(text: str, flag: str) -> tuple[int, int | None]:
    value, _, gpu = text.partition("@")
    try:
        return int(value), (int(gpu) if gpu else None)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: expected NUMBER or NUMBER@GPU, e.g. 79@3") from e


def gather(args: argparse.Namespace, node: str, timeline: Path, now: float, window: float):
    evidence: list[Evidence] = []
    notes: list[str] = []
    if args.precheck_report:
        evidence += taintevidence.from_precheck_report(args.precheck_report, node)
    evidence += taintevidence.culprit_history(timeline, node, now - window)
    if args.iface:
        evidence += taintevidence.probe_nics(
            [i for part in args.iface for i in part.split(",") if i], now
        )
    if args.gpu_watch < 0:
        raise UsageError(f"--gpu-watch {args.gpu_watch:g}: must be >= 0 seconds")
    if not args.no_gpu_probe:
        gpu, note = gpuhealth.probe(args.gpu_watch)
        evidence += gpu
        if note:
            notes.append(note)
    for text in args.xid:
        code, gpu = _code_at(text, "--xid")
        evidence.append(
            Evidence(
                Signal.GPU_XID,
                now,
                "reported",
                incident_id=args.incident_id,
                incident_path=args.incident_path,
                gpu=gpu,
                xid=code,
            )
        )
    for text in args.ecc:
        count, gpu = _code_at(text, "--ecc")
        evidence.append(
            Evidence(
                Signal.GPU_ECC,
                now,
                "reported",
                incident_id=args.incident_id,
                incident_path=args.incident_path,
                gpu=gpu,
                count=count,
            )
        )
    return evidence, notes


def print_outcome(out: TaintOutcome, as_json: bool, notes: Sequence[str] = ()) -> None:
    if as_json:
        doc = {
            "plan": out.plan.to_dict(),
            "dry_run": out.dry_run,
            "applied": out.applied,
            "attempts": out.attempts,
            "event": out.event_name,
            "notes": list(notes),
        }
        print(json.dumps(doc, indent=1, default=str))
        return
    print(out.plan.describe())
    for note in notes:
        print(f"note: {note}")
    if out.dry_run:
        print("dry run: nothing changed")
    elif out.applied:
        retried = f" after {out.attempts - 1} conflict(s)" if out.attempts > 1 else ""
        event = f", event {out.event_name}" if out.event_name else ""
        print(f"applied{retried}{event}")


def run(args: argparse.Namespace) -> int:
    node = resolve_node(args)
    job = args.job or os.environ.get("DIAG_JOB") or ""
    timeline = resolve_timeline(args)
    settings = taintconfig.load(args, job=job, config=args.config)
    now = time.time()
    try:
        evidence, notes = gather(args, node, timeline, now, settings.policy.culprit_window)
        out = taint(settings, node, timeline, evidence, dry_run=args.dry_run)
    except KubeError as e:
        print(f"diag taint: {e}", file=sys.stderr)
        return exitcodes.KUBE_ERROR
    except (OSError, LedgerBusy) as e:
        raise UsageError(timeline_problem(timeline, e)) from e
    print_outcome(out, args.json, notes)
    return exitcodes.OK
