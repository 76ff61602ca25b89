"""`diag untaint`: remove diag's taint, condition and evidence record from a node (its other
taints stay), with an Event saying who and why; the job's taint slot is given back."""

from __future__ import annotations

import argparse
import getpass
import os
import sys

from diag.agent.taint import taintconfig
from diag.agent.taint.flow import expire, untaint
from diag.agent.taint.kube import KubeError, connect, nodes_with_diag_taint
from diag.agent.taint.ledger import LedgerBusy
from diag.cli.taintcmd import (
    add_common,
    print_outcome,
    resolve_node,
    resolve_timeline,
    timeline_problem,
)
from diag.formats import exitcodes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--reason", default="", help="why, for the Event (default: who ran it)")
    parser.add_argument(
        "--expired",
        action="store_true",
        help="only remove taints past their expiry; without --node, on every node carrying "
        "diag's taint (needs `list` on nodes: run it as a CronJob, see deploy/k8s/expiry)",
    )
    taintconfig.add_arguments(parser, agent=False)


def run(args: argparse.Namespace) -> int:
    node = resolve_node(args) if not args.expired else args.node
    job = args.job or os.environ.get("DIAG_JOB") or ""
    settings = taintconfig.load(args, job=job, config=args.config)
    why = args.reason or f"diag untaint by {_who()}"
    timeline = resolve_timeline(args)
    try:
        if args.expired:
            return _expire(args, settings, timeline)
        out = untaint(settings, node, timeline, dry_run=args.dry_run, why=why)
    except KubeError as e:
        print(f"diag untaint: {e}", file=sys.stderr)
        return exitcodes.KUBE_ERROR
    except (OSError, LedgerBusy) as e:
        raise exitcodes.UsageError(timeline_problem(timeline, e)) from e
    print_outcome(out, args.json)
    return exitcodes.OK


def _expire(args: argparse.Namespace, settings: taintconfig.TaintSettings, timeline) -> int:
    api = connect(settings.kubeconfig)
    nodes = [resolve_node(args)] if args.node else nodes_with_diag_taint(api)
    for name in nodes:
        out = expire(settings, name, timeline, dry_run=args.dry_run, api=api)
        print_outcome(out, args.json)
    if not nodes:
        print("no node carries diag's taint")
    return exitcodes.OK


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"
