"""`diag precheck`: flags (falling back to the launcher's environment), then one node's run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from diag.agent.node.units import parse_rate, parse_size
from diag.agent.optiontable.optiontable import bounded_type as _in
from diag.agent.optiontable.optiontable import integer
from diag.agent.precheck.grading import Thresholds
from diag.agent.precheck.precheckconfig import (
    DevicePairs,
    LocalCheck,
    Measure,
    PrecheckSettings,
    Rendezvous,
    Timeouts,
)
from diag.formats import exitcodes
from diag.formats.exitcodes import UsageError
from diag.formats.untrusted import UntrustedInput, printable, write_file_nofollow

log = logging.getLogger(__name__)

_WEEK = 7 * 86400.0


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

    g = p.add_argument_group("what to measure")
    g.add_argument(
        "--checks",
        default=",".join(c.value for c in LocalCheck),
        help="comma-separated subset of device,compute,intra,inter (default: all)",
    )
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument(
        "--net-device", type=_in(0, 1024, integer), default=0, help="local GPU for inter-node tests"
    )
    g.add_argument("--msg-size", help="allreduce size per pair (default 8MiB on CPU, 64MiB GPU)")
    g.add_argument(
        "--pair-seconds", type=_in(0, 3600), default=1.0, help="timed budget per pair (1.0)"
    )
    g.add_argument(
        "--warmup-iters",
        type=_in(0, 1_000_000, integer),
        default=1,
        help="untimed allreduces first (1)",
    )
    g.add_argument(
        "--max-iters",
        type=_in(0, 1_000_000, integer),
        default=50,
        help="timed allreduces at most (50)",
    )
    g.add_argument(
        "--max-rounds", type=_in(0, 1000, integer), default=5, help="inter-node pairing rounds (5)"
    )
    g.add_argument(
        "--matmul-size", type=_in(0, 65536, integer), help="matmul edge (default 512 CPU, 8192 GPU)"
    )
    g.add_argument("--compute-seconds", type=_in(0, 3600), default=1.0, help="matmul budget (1.0)")
    g.add_argument(
        "--compute-threads", type=_in(0, 1024, integer), default=1, help="CPU matmul threads (1)"
    )
    g.add_argument("--copy-size", default="256MiB", help="intra-node copy size (256MiB)")
    g.add_argument(
        "--device-pairs", default="ring", help="intra-node pairs: ring, all, or e.g. 0-1,2-3"
    )

    g = p.add_argument_group("thresholds")
    g.add_argument(
        "--straggler-ratio",
        type=_in(0, 1, lo_open=True),
        default=0.5,
        help="a node whose best busbw is below this x the median is a straggler (0.5)",
    )
    g.add_argument("--min-busbw", help="busbw floor for every link, e.g. 10GB/s or 100Mbit")
    g.add_argument(
        "--compute-ratio", type=_in(0, 1, lo_open=True), default=0.5, help="vs median matmul (0.5)"
    )
    g.add_argument(
        "--copy-ratio", type=_in(0, 1, lo_open=True), default=0.5, help="vs median copy (0.5)"
    )
    g.add_argument("--min-copy-bw", help="intra-node copy floor, e.g. 100GB/s")
    g.add_argument(
        "--max-gpu-memory-used",
        type=_in(0, 1, lo_open=True),
        default=0.3,
        help="fraction in use before (0.3)",
    )
    g.add_argument("--max-gpu-temp", type=_in(0, 200), default=85.0, help="degrees C (85)")

    g = p.add_argument_group("timeouts (seconds)")
    g.add_argument(
        "--rdzv-timeout", type=_in(0, _WEEK), default=300.0, help="for all nodes to join"
    )
    g.add_argument("--connect-timeout", type=_in(0, _WEEK), default=30.0, help="pair connect (30)")
    g.add_argument(
        "--collective-timeout", type=_in(0, _WEEK), default=30.0, help="per allreduce (30)"
    )
    g.add_argument("--local-timeout", type=_in(0, _WEEK), default=300.0, help="local checks (300)")
    g.add_argument(
        "--lost-after", type=_in(0, _WEEK), default=10.0, help="silent node is gone (10)"
    )
    g.add_argument("--heartbeat", type=_in(0, 3600), default=1.0, help="heartbeat interval (1)")


def _from_env(value: object, env: str, what: str) -> str:
    if value is not None:
        return str(value)
    text = os.environ.get(env)
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


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")


def build_config(args: argparse.Namespace) -> PrecheckSettings:
    addr = _from_env(args.master_addr, "MASTER_ADDR", "master-addr")
    port = _int(_from_env(args.master_port, "MASTER_PORT", "master-port"), "master-port", "")
    nnodes_text = _from_env(args.nnodes, "NNODES", "nnodes")
    if ":" in nnodes_text:
        raise UsageError(f"nnodes {nnodes_text!r} is a range; precheck needs the exact node count")
    nnodes = _int(nnodes_text, "nnodes", "NNODES")
    rank = _int(_from_env(args.node_rank, "NODE_RANK", "node-rank"), "node-rank", "NODE_RANK")
    if nnodes < 1:
        raise UsageError("nnodes must be at least 1")
    if not 0 <= rank < nnodes:
        raise UsageError(f"node rank {rank} is outside 0..{nnodes - 1}")
    if not 0 < port < 65536:
        raise UsageError(f"master port {port} is not a TCP port")
    _positive(
        args,
        "pair_seconds",
        "max_iters",
        "compute_seconds",
        "compute_threads",
        "rdzv_timeout",
        "connect_timeout",
        "collective_timeout",
        "local_timeout",
        "lost_after",
        "heartbeat",
        "max_rounds",
    )
    if args.warmup_iters < 0:
        raise UsageError("--warmup-iters must be 0 or more")
    for name in ("straggler_ratio", "compute_ratio", "copy_ratio", "max_gpu_memory_used"):
        if not 0 < getattr(args, name) <= 1:
            raise UsageError(f"--{name.replace('_', '-')} must be in (0, 1]")
    if args.heartbeat * 2 > args.lost_after:
        raise UsageError("--lost-after must be at least twice --heartbeat")
    try:
        checks = frozenset(LocalCheck(c.strip()) for c in args.checks.split(",") if c.strip())
        pairs = DevicePairs.parse(args.device_pairs)
        msg = parse_size(args.msg_size) if args.msg_size else None
        copy = parse_size(args.copy_size)
        min_busbw = parse_rate(args.min_busbw) if args.min_busbw else None
        min_copy = parse_rate(args.min_copy_bw) if args.min_copy_bw else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.iface:
        import psutil

        known = sorted(psutil.net_if_addrs())
        if args.iface not in known:
            raise UsageError(f"no interface {args.iface!r} here; known: {', '.join(known)}")
    if msg is not None and msg < 8:
        raise UsageError("--msg-size must be at least 8 bytes")
    if args.matmul_size is not None and args.matmul_size < 16:
        raise UsageError("--matmul-size must be at least 16")
    return PrecheckSettings(
        rdzv=Rendezvous(addr, port, nnodes, rank, args.iface),
        job=args.job or os.environ.get("DIAG_JOB") or "default",
        timeouts=Timeouts(
            rdzv_s=args.rdzv_timeout,
            connect_s=args.connect_timeout,
            collective_s=args.collective_timeout,
            local_s=args.local_timeout,
            lost_after_s=args.lost_after,
            heartbeat_s=args.heartbeat,
        ),
        measure=Measure(
            device=args.device,
            msg_bytes=msg,
            pair_seconds=args.pair_seconds,
            warmup_iters=args.warmup_iters,
            max_iters=args.max_iters,
            matmul_size=args.matmul_size,
            compute_seconds=args.compute_seconds,
            compute_threads=args.compute_threads,
            copy_bytes=copy,
            device_pairs=pairs,
            net_device=args.net_device,
            checks=checks,
        ),
        thresholds=Thresholds(
            straggler_ratio=args.straggler_ratio,
            min_busbw=min_busbw,
            compute_ratio=args.compute_ratio,
            copy_ratio=args.copy_ratio,
            min_copy_bw=min_copy,
            max_gpu_memory_used=args.max_gpu_memory_used,
            max_gpu_temp_c=args.max_gpu_temp,
        ),
        max_rounds=args.max_rounds,
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
