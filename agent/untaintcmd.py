"""`diag untaint`: remove diag's taint, condition and evidence record from a node (its other
taints stay), with an Event saying who and why; the job's taint slot is given back."""

from __future__ import annotations

import argparse
import getpass
import os
import sys

from diag.agent import exitcodes, taintconfig
from diag.agent.kube import KubeError
from diag.agent.taintcmd import (
    add_common,
    print_outcome,
    resolve_node,
    resolve_timeline,
    timeline_problem,
)
from diag.agent.taintflow import untaint
from diag.agent.taintledger import LedgerBusy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--reason", default="", help="why, for the Event (default: who ran it)")
    taintconfig.add_arguments(parser, with_mode=False)


def run(args: argparse.Namespace) -> int:
    node = resolve_node(args)
    job = args.job or os.environ.get("DIAG_JOB") or ""
    settings = taintconfig.load(args, job=job, config=args.config)
    why = args.reason or f"diag untaint by {_who()}"
    timeline = resolve_timeline(args)
    try:
        out = untaint(settings, node, timeline, dry_run=args.dry_run, why=why)
    except KubeError as e:
        print(f"diag untaint: {e}", file=sys.stderr)
        return exitcodes.KUBE_ERROR
    except (OSError, LedgerBusy) as e:
        raise exitcodes.UsageError(timeline_problem(timeline, e)) from e
    print_outcome(out, args.json)
    return exitcodes.OK


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"
