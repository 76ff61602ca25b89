"""`diag precheck`: flags (falling back to the launcher's environment), then one node's run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from diag.agent.config import precheckoptions
from diag.agent.precheck.precheckconfig import PrecheckSettings, Rendezvous
from diag.formats import exitcodes
from diag.formats.exitcodes import UsageError
from diag.formats.untrusted import UntrustedInput, printable, write_file_nofollow

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Check devices, compute and the network of every node before training and name the "
        "faulty and straggling nodes. Run it on every node with the same rendezvous settings. "
        "Exit code: 0 healthy, 4 faulty/straggling/suspect nodes found, 5 could not run, "
        "2 bad flags."
    )
    g = p.add_argument_group("rendezvous (flags override the launcher's environment)")
    g.add_argument("--master-addr", help="host of node 0, which runs the store [MASTER_ADDR]")
    g.add_argument("--master-port", type=int, help="store port on node 0 [MASTER_PORT]")
    g.add_argument("--nnodes", help="number of nodes [NNODES]")
    g.add_argument("--node-rank", type=int, help="this node's rank, 0..nnodes-1 [NODE_RANK]")
    g.add_argument(
        "--iface", help="network interface for inter-node traffic (default: the route to master)"
    )
    g.add_argument("--job", help="job name, the `job` label of metrics [DIAG_JOB, else default]")

    g = p.add_argument_group("output")
    g.add_argument("--report", type=Path, help="write the JSON report to this file")
    g.add_argument(
        "--metrics-file", type=Path, help="write Prometheus metrics here (textfile format, .prom)"
    )
    g.add_argument("--json", action="store_true", help="print the JSON report instead of a table")

    g.add_argument(
        "--config",
        type=Path,
        help="a TOML file whose [precheck] table holds the options below (the agent's file can "
        "hold it beside [agent])",
    )
    precheckoptions.add_arguments(p)


def _from_env(value: object, env: str, what: str, environ: Mapping[str, str]) -> str:
    if value is not None:
        return str(value)
    text = environ.get(env)
    if not text:
        raise UsageError(f"{what} is not set: pass --{what} or set {env}")
    return text


def _int(text: str, what: str, env: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(
            f"{what} must be a whole number, got {text!r} (from --{what} or {env})"
        ) from None


def build_config(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> PrecheckSettings:
    addr = _from_env(args.master_addr, "MASTER_ADDR", "master-addr", env)
    port = _int(_from_env(args.master_port, "MASTER_PORT", "master-port", env), "master-port", "")
    nnodes_text = _from_env(args.nnodes, "NNODES", "nnodes", env)
    if ":" in nnodes_text:
        raise UsageError(f"nnodes {nnodes_text!r} is a range; precheck needs the exact node count")
    nnodes = _int(nnodes_text, "nnodes", "NNODES")
    rank = _int(_from_env(args.node_rank, "NODE_RANK", "node-rank", env), "node-rank", "NODE_RANK")
    if nnodes < 1:
        raise UsageError("nnodes must be at least 1")
    if not 0 <= rank < nnodes:
        raise UsageError(f"node rank {rank} is outside 0..{nnodes - 1}")
    if not 0 < port < 65536:
        raise UsageError(f"master port {port} is not a TCP port")
    if args.iface:
        import psutil

        known = sorted(psutil.net_if_addrs())
        if args.iface not in known:
            raise UsageError(f"no interface {args.iface!r} here; known: {', '.join(known)}")
    return precheckoptions.settings(
        args,
        Rendezvous(addr, port, nnodes, rank, args.iface),
        job=args.job or env.get("DIAG_JOB") or "default",
        env=env,
        config=args.config,
    )


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    for path in (args.report, args.metrics_file):
        if path is not None and path.exists() and path.is_dir():
            raise UsageError(f"{path} is a directory; give a file name")
    # c10d logs harmless socket warnings (reverse DNS in containers); our report says what failed.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from diag.agent.precheck.session import NodeSession
    from diag.agent.precheck.table import render

    session = NodeSession(cfg)
    report = session.run()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(printable(render(report)))  # host names come from the other nodes
    sys.stdout.flush()
    try:
        if args.report is not None:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            data = (json.dumps(report.to_dict(), indent=2) + "\n").encode()
            write_file_nofollow(args.report, data, mode=0o644)
        if args.metrics_file is not None:
            from diag.agent.precheck.promfile import write_textfile

            write_textfile(report, args.metrics_file)
    except (OSError, UntrustedInput) as e:
        log.error("could not write the report: %s", e)
        return exitcodes.PRECHECK_ERROR
    if session.stuck:
        # A thread is still blocked in native code (a collective on a dead link); normal
        # interpreter shutdown could wait on it forever. Everything is written: leave now.
        sys.stderr.flush()
        os._exit(report.exit_code)
    return report.exit_code
