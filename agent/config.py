"""The agent's configuration, read once at the entry point: flags > environment > file > default.

Every option has a flag (`--hang-timeout`), an environment variable (`DIAG_HANG_TIMEOUT`) and a
key in the `[agent]` table of a TOML file given with `--config` (`hang_timeout = 120`).
"""

from __future__ import annotations

import argparse
import enum
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.agent import taintconfig
from diag.agent.checkpoint.manager import CheckpointOptions
from diag.agent.drain import DEFAULT_GRACE_S, DEFAULT_MARGIN_S, DrainSettings
from diag.agent.exitcodes import UsageError
from diag.agent.hang import OnHang, Policy
from diag.agent.metrics.precheck import DEFAULT_NAME as PRECHECK_FILE
from diag.agent.metrics.xputimer import PORT_ENV as XPU_TIMER_PORT_ENV
from diag.agent.metrics.xputimer import XpuTimerIdentity
from diag.agent.notice import NoticeSettings, Provider
from diag.agent.taintconfig import TaintSettings
from diag.agent.timeouts import TimeoutPolicy
from diag.collector.rundir import default_run_dir, node_name

DEFAULT_TIMELINE = "/root/timeline"  # where xpu_timer writes, so DLRover users find it there


class Until(enum.Enum):
    FOREVER = "forever"  # a sidecar: run until the pod stops
    INCIDENT = "incident"  # exit after handling the first incident
    JOB_END = "job-end"  # exit when every local rank has ended


@dataclass(frozen=True)
class AgentConfig:
    run_dir: Path
    timeline: Path
    node: str
    job: str | None = None
    interval: float = 0.5
    policy: Policy = field(default_factory=Policy)
    until: Until = Until.FOREVER
    stop_grace: float = 10.0
    native_stacks: bool = True
    pyspy_timeout: float = 10.0
    dump_parallel: int = 0  # 0: from the container's CPU quota (memory always bounds it)
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    xpu_timer: XpuTimerIdentity | None = None  # expose XPU_TIMER_COMMON_HANG when set
    precheck_metrics: Path | None = None  # textfile of `diag precheck --metrics-file`
    control: bool = True
    control_socket: Path | None = None  # None: derived from the run dir and job
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    taint: TaintSettings = field(default_factory=TaintSettings)
    drain: DrainSettings | None = field(default_factory=DrainSettings)  # None: stop on SIGTERM
    notice: NoticeSettings | None = None  # the early preemption notice watcher; None: off


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


def _phases(text: str) -> dict[str, float]:
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


def _port(text: str) -> int:
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
    _Opt("phase_timeout", _phases, {}, "per-phase limits, NAME=SECONDS[,NAME=SECONDS]"),
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
    _Opt("metrics_port", _port, None, "serve Prometheus metrics on this port (0: any free port)"),
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


def _removed(args: argparse.Namespace, env: Mapping[str, str], file_keys: set[str]) -> None:
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


def load(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> AgentConfig:
    file_values: dict[str, Any] = {}
    if getattr(args, "config", None):
        file_values = _read_file(args.config)
    _removed(args, env, set(file_values))
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw, source = getattr(args, opt.name, None), opt.flag
        if raw is None and opt.env in env:
            raw, source = env[opt.env], opt.env
        if raw is None and opt.name in file_values:
            raw, source = file_values[opt.name], f"{args.config}: {opt.name}"
        if raw is None:
            values[opt.name] = opt.default
            continue
        if opt.choices and str(raw) not in opt.choices:
            raise UsageError(f"{source}: {raw!r} is not one of {', '.join(opt.choices)}")
        try:
            values[opt.name] = (
                _phases(",".join(f"{k}={v}" for k, v in raw.items()))
                if isinstance(raw, dict)
                else opt.parse(str(raw))
            )
        except ValueError as e:
            raise UsageError(f"{source}: {e}") from e
    try:
        timeouts = TimeoutPolicy(
            ceiling=values["hang_timeout"],
            floor=min(values["hang_floor"], values["hang_timeout"]),
            factor=values["hang_factor"],
            warmup_steps=values["warmup_steps"],
            warmup_timeout=values["warmup_timeout"],
            warmup_cadence=values["warmup_cadence"],
            phase_timeouts=values["phase_timeout"],
            default_phase_timeout=values["default_phase_timeout"],
        )
    except ValueError as e:
        raise UsageError(str(e)) from e
    run_dir = values["run_dir"] or default_run_dir(env)
    metrics_port = values["metrics_port"]
    xpu_timer = None
    if values["xpu_timer_compat"]:
        xpu_timer = XpuTimerIdentity.from_env(env, values["job"])
        if metrics_port is None:
            metrics_port = _xpu_timer_port(env)
    return AgentConfig(
        run_dir=run_dir,
        timeline=values["timeline"],
        node=values["node"] or node_name(env),
        job=values["job"],
        interval=values["interval"],
        policy=Policy(
            timeouts=timeouts,
            on_hang=OnHang(values["on_hang"]),
            persist_on_incident=values["persist_on_incident"],
        ),
        until=Until(values["until"]),
        stop_grace=values["stop_grace"],
        native_stacks=values["native_stacks"],
        pyspy_timeout=values["pyspy_timeout"],
        dump_parallel=values["dump_parallel"],
        metrics_port=metrics_port,
        metrics_host=values["metrics_host"],
        xpu_timer=xpu_timer,
        precheck_metrics=values["precheck_metrics"] or run_dir / PRECHECK_FILE,
        control=values["control"],
        control_socket=values["control_socket"],
        checkpoint=CheckpointOptions(
            save_dir=values["save_dir"],
            keep_last=values["keep_last"],
            linger=values["snapshot_linger"],
            workers=max(1, values["persist_workers"]),
            persist_on_death=values["persist_on_incident"],
        ),
        drain=_drain_settings(values) if values["drain"] else None,
        notice=_notice_settings(values),
        taint=taintconfig.load(
            args, job=values["job"], env=env, config=getattr(args, "config", None)
        ),
    )


def _drain_settings(values: dict[str, Any]) -> DrainSettings:
    try:
        return DrainSettings(
            grace=values["termination_grace"],
            margin=values["drain_margin"],
            stop_grace=min(values["stop_grace"], 0.5),
        )
    except ValueError as e:
        raise UsageError(f"{e}: set --termination-grace and --drain-margin") from e


def _notice_settings(values: dict[str, Any]) -> NoticeSettings | None:
    provider = Provider(values["preemption_notice"])
    if provider == Provider.NONE:
        if values["notice_url"]:
            raise UsageError(
                "--notice-url is set but --preemption-notice is none: name the provider "
                "(aws or gce), whose responses the URL gives"
            )
        return None
    try:
        return NoticeSettings.of(provider, values["notice_url"], values["notice_interval"])
    except ValueError as e:
        raise UsageError(f"--notice-url: {e}") from e


def _xpu_timer_port(env: Mapping[str, str]) -> int:
    raw = env.get(XPU_TIMER_PORT_ENV)
    if raw is None:
        raise UsageError(
            "--xpu-timer-compat needs a metrics port: set --metrics-port (DIAG_METRICS_PORT) or "
            f"{XPU_TIMER_PORT_ENV}, the port DLRover's agent scrapes"
        )
    try:
        return _port(raw)
    except ValueError as e:
        raise UsageError(f"{XPU_TIMER_PORT_ENV}: {e}") from e


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise UsageError(f"--config {path}: no such file") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from e
    table = raw.get("agent", {k: v for k, v in raw.items() if k != "taint"})
    known = {o.name for o in OPTIONS} | set(REMOVED)
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in known:
            raise UsageError(f"--config {path}: unknown option {key!r} in [agent]")
        out[name] = value
    return out
