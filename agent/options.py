"""The agent's options: one table, each option a flag (`--hang-timeout`), an environment
variable (`DIAG_HANG_TIMEOUT`) and a key of the `[agent]` table of the `--config` TOML file;
their parsers, and the options of earlier versions that fail loudly. `config.load` reads them.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.agent import taintconfig
from diag.agent.drain import DEFAULT_GRACE_S, DEFAULT_MARGIN_S
from diag.agent.exitcodes import UsageError
from diag.agent.hang import OnHang
from diag.agent.metrics.precheck import DEFAULT_NAME as PRECHECK_FILE
from diag.agent.metrics.xputimer import PORT_ENV as XPU_TIMER_PORT_ENV
from diag.agent.notice import Provider

DEFAULT_TIMELINE = "/root/timeline"  # where xpu_timer writes, so DLRover users find it there


class Until(enum.Enum):
    FOREVER = "forever"  # a sidecar: run until the pod stops
    INCIDENT = "incident"  # exit after handling the first incident
    JOB_END = "job-end"  # exit when every local rank has ended


@dataclass(frozen=True)
class _Opt:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "DIAG_" + self.name.upper()


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text}")
    return value


def parse_phases(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, seconds = part.partition("=")
        if not sep or not name:
            raise ValueError(f"expected NAME=SECONDS, got {part!r}")
        out[name.strip()] = _positive(seconds)
    return out


def _bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text}")
    return value


def parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port < 65536:
        raise ValueError(f"not a TCP port: {text}")
    return port


OPTIONS = (
    _Opt(
        "run_dir",
        Path,
        None,
        "directory of the ranks' op journals (shared with the trainer; "
        "default: $DIAG_RUN_DIR, else /dev/shm/diag)",
    ),
    _Opt("timeline", Path, Path(DEFAULT_TIMELINE), "where incident directories are written"),
    _Opt("job", str, None, "watch only journals of this job (default: all in the run dir)"),
    _Opt("node", str, None, "this node's name in incidents (default: $NODE_NAME or hostname)"),
    _Opt(
        "hang_timeout",
        _positive,
        300.0,
        "ceiling of the hang limit in seconds; the limit adapts "
        "below it and stays under torch's collective timeout",
    ),
    _Opt("hang_floor", _positive, 10.0, "floor of the adaptive hang limit in seconds"),
    _Opt("hang_factor", _positive, 5.0, "adaptive limit = factor x slowest recent step/op"),
    _Opt("warmup_steps", int, 2, "steps before the adaptive limit applies"),
    _Opt("warmup_timeout", _positive, 900.0, "hang limit during the warm-up steps"),
    _Opt(
        "warmup_cadence",
        _non_negative,
        30.0,
        "a rank that marks no steps leaves warm-up after its ops completed at a steady pace for "
        "this many seconds (0: it keeps the warm-up limit)",
    ),
    _Opt("phase_timeout", parse_phases, {}, "per-phase limits, NAME=SECONDS[,NAME=SECONDS]"),
    _Opt("default_phase_timeout", _positive, 1800.0, "limit inside phases not listed"),
    _Opt(
        "on_hang",
        str,
        "none",
        "what to do after the evidence is on disk",
        choices=tuple(m.value for m in OnHang),
    ),
    _Opt("stop_grace", _positive, 10.0, "seconds between SIGTERM and SIGKILL when stopping ranks"),
    _Opt("interval", _positive, 0.5, "seconds between checks (deaths are seen at once)"),
    _Opt("until", str, "forever", "when the agent exits", choices=tuple(m.value for m in Until)),
    _Opt("native_stacks", _bool, True, "include native frames in stack dumps (py-spy --native)"),
    _Opt("pyspy_timeout", _positive, 10.0, "seconds allowed for one stack dump"),
    _Opt(
        "dump_parallel",
        _count,
        0,
        "stack dumps run at once (0: from the container's CPU quota); never more than its "
        "memory limit leaves room for",
    ),
    _Opt(
        "metrics_port", parse_port, None, "serve Prometheus metrics on this port (0: any free port)"
    ),
    _Opt("metrics_host", str, "0.0.0.0", "address the metrics server binds"),
    _Opt(
        "xpu_timer_compat",
        _bool,
        False,
        "also expose xpu_timer's XPU_TIMER_COMMON_HANG gauge, so DLRover's hang diagnosis acts "
        f"on our detection (metrics port defaults to ${XPU_TIMER_PORT_ENV}, which DLRover scrapes)",
    ),
    _Opt(
        "precheck_metrics",
        Path,
        None,
        "re-export this `diag precheck --metrics-file` textfile "
        f"(default: <run dir>/{PRECHECK_FILE})",
    ),
    _Opt("control", _bool, True, "serve the control channel (commands, flash-checkpoint persists)"),
    _Opt(
        "control_socket",
        Path,
        None,
        "unix socket of the control channel (default: <run dir>/<job>.control.sock, or "
        "<run dir>/diag.control.sock without --job)",
    ),
    _Opt(
        "persist_on_incident",
        _bool,
        True,
        "on a rank death or a hang, persist the newest flash checkpoints before acting",
    ),
    _Opt(
        "save_dir",
        Path,
        None,
        "where flash checkpoints are persisted (default: the save dir the trainer names; set it "
        "when storage is mounted elsewhere in the sidecar)",
    ),
    _Opt("keep_last", _count, 3, "persisted steps to keep in the save dir (0: all)"),
    _Opt(
        "snapshot_linger",
        _positive,
        300.0,
        "seconds to keep the in-memory checkpoints of a job whose ranks died (for a restart)",
    ),
    _Opt("persist_workers", _count, 2, "threads writing checkpoints to storage"),
    _Opt(
        "drain",
        _bool,
        True,
        "on SIGTERM, drain: EXIT to the ranks, persist their newest checkpoint, then exit "
        "(false: stop at once)",
    ),
    _Opt(
        "termination_grace",
        _positive,
        DEFAULT_GRACE_S,
        "seconds between SIGTERM and SIGKILL (the pod's terminationGracePeriodSeconds)",
    ),
    _Opt(
        "drain_margin",
        _non_negative,
        DEFAULT_MARGIN_S,
        "seconds of the grace period the drain leaves unused, for the agent's own exit",
    ),
    _Opt(
        "preemption_notice",
        str,
        "none",
        "poll the cloud's metadata server for a reclaim notice and drain early",
        choices=tuple(m.value for m in Provider),
    ),
    _Opt(
        "notice_url",
        str,
        None,
        "the metadata URL polled (default: the provider's: AWS spot instance-action, GCE "
        "preempted)",
    ),
    _Opt("notice_interval", _positive, 5.0, "seconds between polls of the metadata URL"),
)

_BOARD_GONE = (
    "the peer board is gone; a rank on another node is named by the job verdict, from the views "
    "the nodes file with their incident reports"
)
REMOVED = {"peers": _BOARD_GONE, "peers_dir": _BOARD_GONE, "peer_interval": _BOARD_GONE}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="TOML file with an [agent] table (and a [taint] table)"
    )
    for opt in OPTIONS:
        default = opt.default if not isinstance(opt.default, dict) else ""
        parser.add_argument(
            opt.flag,
            dest=opt.name,
            default=None,
            choices=opt.choices,
            help=f"{opt.help} [env {opt.env}; default {default}]",
        )
    for name in REMOVED:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, help=argparse.SUPPRESS)
    taintconfig.add_arguments(parser)


def check_removed(args: argparse.Namespace, env: Mapping[str, str], file_keys: set[str]) -> None:
    """Options of earlier versions fail loudly: a silently ignored setting misleads."""
    for name, why in REMOVED.items():
        flag, var = f"--{name.replace('_', '-')}", f"DIAG_{name.upper()}"
        if getattr(args, name, None) is not None:
            where = flag
        elif var in env:
            where = var
        elif name in file_keys:
            where = f"{args.config}: {name}"
        else:
            continue
        raise UsageError(f"{where} was removed: {why}; drop it")
