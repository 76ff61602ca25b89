"""`diag launch`: torchrun with a warm spare per node. Takes torchrun's arguments; a worker that
dies while the others run is replaced alone by a spare when its script runs under
`diag.trainer.resilient` (the survivors recover in place), else every worker restarts, as
under torchrun."""

from __future__ import annotations

import argparse

from diag.formats import exitcodes

MAX_SPARES = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", default="1:1", help="nodes, N or MIN:MAX (as torchrun)")
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", default="1",
        help="workers per node: a number, or cpu/gpu/auto (as torchrun)",
    )  # fmt: skip
    parser.add_argument("--rdzv-backend", "--rdzv_backend", default="static",
                        help="rendezvous backend: static or c10d (as torchrun)")  # fmt: skip
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                        help="rendezvous endpoint, HOST:PORT")  # fmt: skip
    parser.add_argument("--rdzv-id", "--rdzv_id", default="none", help="the job's id")
    parser.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                        help="rendezvous configuration, KEY=VALUE,... (as torchrun)")  # fmt: skip
    parser.add_argument("--standalone", action="store_true",
                        help="one node with a rendezvous of its own on a free port")  # fmt: skip
    parser.add_argument(
        "--max-restarts", "--max_restarts", type=int, default=0,
        help="failures the job survives: each worker replaced in place and each restart of "
        "every worker spends one (as torchrun's restarts)",
    )  # fmt: skip
    parser.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1,
                        help="seconds between looks at the workers")  # fmt: skip
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0,
                        help="this node's rank (static rendezvous)")  # fmt: skip
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                        help="the static rendezvous's store host")  # fmt: skip
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help="the static rendezvous's store port")  # fmt: skip
    parser.add_argument("--local-addr", "--local_addr", default=None,
                        help="this node's address for the rendezvous (as torchrun)")  # fmt: skip
    parser.add_argument(
        "--spares", type=int, default=1,
        help="warm spares per node: processes with torch, DeepSpeed and diag imported, waiting "
        "to take a dead worker's rank; 0: a replacement is a new process",
    )  # fmt: skip
    parser.add_argument(
        "--spare-delay", type=float, default=15.0,
        help="seconds from a worker of the node first seen under @resilient to its spares' "
        "start (their imports would slow the workers' engines); a rank that dies sooner gets "
        "a new process",
    )  # fmt: skip
    parser.add_argument("training_script", help="the training script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER,
                        help="the script's arguments")  # fmt: skip


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The options as torchrun's command line, for torchrun's own parser."""
    out = [
        f"--nnodes={args.nnodes}", f"--nproc-per-node={args.nproc_per_node}",
        f"--rdzv-backend={args.rdzv_backend}", f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.rdzv_id}", f"--rdzv-conf={args.rdzv_conf}",
        f"--max-restarts={args.max_restarts}", f"--monitor-interval={args.monitor_interval}",
        f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
    ]  # fmt: skip
    if args.master_port is not None:
        out.append(f"--master-port={args.master_port}")
    if args.local_addr is not None:
        out.append(f"--local-addr={args.local_addr}")
    return out


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.spares <= MAX_SPARES:
        raise exitcodes.UsageError(f"--spares {args.spares}: give 0 to {MAX_SPARES}")
    if not 0 <= args.spare_delay <= 3600:  # NaN fails too
        raise exitcodes.UsageError(f"--spare-delay {args.spare_delay}: give 0 to 3600 seconds")
    if args.max_restarts < 0:
        raise exitcodes.UsageError(f"--max-restarts {args.max_restarts}: give 0 or more")
    if not args.monitor_interval > 0:
        raise exitcodes.UsageError("--monitor-interval: give a positive number of seconds")
    from diag.launch.launcher import LaunchArgs, launch

    return launch(LaunchArgs(torchrun_argv(args), args.training_script,
                             list(args.training_script_args), args.spares, args.standalone,
                             args.spare_delay))  # fmt: skip
