"""`diag demo`'s settings and flags, standard library only: `diag demo --help` answers before
the demo's environment (torch, DeepSpeed: 1.8 GB) is set up, as scripts/demo.sh asks it to."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

# The faults diag.trainer.demo_job injects (a test holds the two lists equal; importing the job
# here would import torch).
FAULTS = ("none", "hang", "exit", "gil", "straggler")


@dataclass(frozen=True)
class DemoSettings:
    nproc: int = 4
    fault: str = "hang"
    fault_rank: int = 1
    fault_step: int = 6
    steps: int = 40
    zero: int = 2
    hang_timeout: float = 20.0
    hang_floor: float = 3.0
    straggle: float = 0.3
    on_hang: str = "stop"
    timeout: float = 240.0
    workdir: Path | None = None
    job_args: tuple[str, ...] = ()  # extra demo_job flags (tests use them for eval phases etc.)
    # A launcher command ending where the module name goes (e.g. the deepspeed launcher's
    # `... --module`); empty: torchrun.
    merge: bool = True
    launcher: tuple[str, ...] = ()
    metrics_port: int | None = None  # the agent serves /metrics here (0: any free port)
    agent_args: tuple[str, ...] = ()  # extra `diag agent` flags
    flash_every: int = 0  # flash-checkpoint every N steps; the agent persists one on the fault


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoSettings()
    parser.add_argument("--nproc", type=int, default=d.nproc, help="ranks to start")
    parser.add_argument("--fault", choices=FAULTS, default=d.fault, help="what to inject")
    parser.add_argument(
        "--fault-rank", type=int, default=d.fault_rank, help="the rank the fault is injected in"
    )
    parser.add_argument(
        "--fault-step", type=int, default=d.fault_step, help="the training step it strikes at"
    )
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps to run")
    parser.add_argument(
        "--zero", type=int, choices=(0, 1, 2, 3), default=d.zero, help="DeepSpeed ZeRO stage"
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=d.hang_timeout,
        help="the agent's hang-limit ceiling in seconds",
    )
    parser.add_argument(
        "--hang-floor",
        type=float,
        default=d.hang_floor,
        help="the agent's hang-limit floor in seconds (the limit adapts to the step time "
        "between the two)",
    )
    parser.add_argument(
        "--straggle", type=float, default=d.straggle, help="extra seconds per step of the straggler"
    )
    parser.add_argument(
        "--on-hang",
        choices=("none", "stop"),
        default=d.on_hang,
        help="what the agent does after the evidence of a hang: stop the ranks, or nothing",
    )
    parser.add_argument(
        "--timeout", type=float, default=d.timeout, help="give up after this many seconds"
    )
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: a temp dir)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="the agent serves Prometheus metrics on this port during the demo",
    )
    parser.add_argument(
        "--flash-every",
        type=int,
        default=0,
        help="flash-checkpoint every N steps; the agent persists the newest on the fault",
    )


def settings(args: argparse.Namespace) -> DemoSettings:
    return DemoSettings(
        nproc=args.nproc, fault=args.fault, fault_rank=args.fault_rank,
        fault_step=args.fault_step, steps=args.steps, zero=args.zero,
        hang_timeout=args.hang_timeout, hang_floor=args.hang_floor, straggle=args.straggle,
        on_hang=args.on_hang, timeout=args.timeout, workdir=args.workdir,
        metrics_port=args.metrics_port, flash_every=args.flash_every,
    )  # fmt: skip
