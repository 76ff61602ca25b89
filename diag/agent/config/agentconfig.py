"""The agent's configuration, read once at the entry point: flags > environment > file > default.

Every option has a flag (`--hang-timeout`), an environment variable (`DIAG_HANG_TIMEOUT`) and a
key in the `[agent]` table of a TOML file given with `--config` (`hang_timeout = 120`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.agent.checkpoint.manager import CheckpointSettings
from diag.agent.config.options import OPTIONS, Until, parse_port
from diag.agent.config.options import add_arguments as add_arguments
from diag.agent.config.removed import REMOVED, check_removed
from diag.agent.detect.hang import OnHang, Policy
from diag.agent.detect.timeouts import TimeoutPolicy
from diag.agent.drain.notice import NoticeSettings, Provider
from diag.agent.drain.plan import DrainSettings
from diag.agent.metrics.prechecktext import DEFAULT_NAME as PRECHECK_FILE
from diag.agent.metrics.xputimer import PORT_ENV as XPU_TIMER_PORT_ENV
from diag.agent.metrics.xputimer import XpuTimerIdentity
from diag.agent.observe.rundircheck import TrainerUsers
from diag.agent.optiontable.optiontable import Option, read_toml_table
from diag.agent.replica.auth import MIN_TOKEN_CHARS, token_problem
from diag.agent.replica.settings import ReplicaSettings
from diag.agent.replica.tls import TlsFiles
from diag.agent.retention.policy import DEFAULT_INCIDENT_RETENTION, Retention
from diag.agent.taint import taintconfig
from diag.agent.taint.taintconfig import TaintSettings
from diag.formats.exitcodes import UsageError
from diag.formats.rundir import default_run_dir, node_name


@dataclass(frozen=True)
class AgentSettings:
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
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    taint: TaintSettings = field(default_factory=TaintSettings)
    drain: DrainSettings | None = field(default_factory=DrainSettings)  # None: stop on SIGTERM
    notice: NoticeSettings | None = None  # the early preemption notice watcher; None: off
    trainer: TrainerUsers = field(default_factory=TrainerUsers)  # --trainer-uid / --trainer-gid
    retention: Retention = DEFAULT_INCIDENT_RETENTION  # of the incident directories it writes
    replica: ReplicaSettings | None = None  # replicas of flash checkpoints in peers; None: off
    state_dir: Path | None = None  # the agent's own directory; None: privilege.statedir's default


def load(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> AgentSettings:
    file_values: dict[str, Any] = {}
    config: Path | None = getattr(args, "config", None)
    if config:
        known = [o.name for o in OPTIONS.options] + list(REMOVED)
        file_values = read_toml_table(
            config, "agent", known, top_level_default=True, other_tables=("taint", "precheck")
        )
    check_removed(args, env, set(file_values))
    values = OPTIONS.resolve(args, env, file_values, config, from_file=_from_file)
    try:
        timeouts = TimeoutPolicy(
            ceiling=values["hang_timeout"],
            floor=min(values["hang_floor"], values["hang_timeout"]),
            factor=values["hang_factor"],
            idle_factor=values["idle_factor"],
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
    node = values["node"] or node_name(env)
    return AgentSettings(
        run_dir=run_dir,
        timeline=values["timeline"],
        node=node,
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
        checkpoint=CheckpointSettings(
            save_dir=values["save_dir"],
            keep_last=values["keep_last"],
            linger=values["snapshot_linger"],
            workers=max(1, values["persist_workers"]),
            persist_on_death=values["persist_on_incident"],
        ),
        drain=_drain_settings(values) if values["drain"] else None,
        notice=_notice_settings(values),
        trainer=TrainerUsers(values["trainer_uid"], values["trainer_gid"]),
        retention=Retention(
            count=values["keep_incidents"],
            max_age=values["keep_incident_days"] * 86400.0,
            max_bytes=values["keep_incident_bytes"],
        ),
        taint=taintconfig.load(
            args, job=values["job"], env=env, config=getattr(args, "config", None)
        ),
        replica=_replica_settings(values, node),
        state_dir=values["state_dir"],
    )


def _replica_settings(values: dict[str, Any], node: str) -> ReplicaSettings | None:
    nodes = values["replica_nodes"]
    if not nodes:
        return None
    if not values["job"]:
        raise UsageError("--replica-nodes needs --job: replicas are of one job's checkpoints")
    if node not in {n.name for n in nodes}:
        raise UsageError(
            f"this node, {node!r}, is not in --replica-nodes: name it there as --node (or "
            "$DIAG_NODE, $NODE_NAME, the hostname) names it"
        )
    token = values["replica_token"] or ""
    problem = token_problem(token)
    if problem is not None:
        raise UsageError(
            f"--replica-nodes needs the job's replica token, which {problem}: set "
            f"DIAG_REPLICA_TOKEN to one secret of at least {MIN_TOKEN_CHARS} characters, the "
            "same on every node of the job (e.g. `openssl rand -hex 32`, kept in a Kubernetes "
            "Secret); agents prove they hold it without sending it"
        )
    return ReplicaSettings(
        nodes=nodes,
        factor=values["replica_factor"],
        token=token,
        max_bytes=values["replica_max_bytes"],
        directory=values["replica_dir"],
        interval=values["replica_interval"],
        listen_host=values["replica_listen"],
        max_rate=values["replica_max_rate"],
        lost_after=values["replica_lost_after"],
        pull_deadline=values["replica_pull_deadline"],
        tls=_tls_files(values),
    )


def _tls_files(values: dict[str, Any]) -> TlsFiles | None:
    names = ("replica_tls_cert", "replica_tls_key", "replica_tls_ca")
    given = [values[n] for n in names]
    if not any(given):
        return None
    if not all(given):
        missing = ", ".join(
            f"--{n.replace('_', '-')}" for n, v in zip(names, given, strict=True) if not v
        )
        raise UsageError(
            f"TLS between agents needs all three --replica-tls-* options: set {missing}"
        )
    cert, key, ca = given
    return TlsFiles(cert, key, ca)


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
        return parse_port(raw)
    except ValueError as e:
        raise UsageError(f"{XPU_TIMER_PORT_ENV}: {e}") from e


def _from_file(opt: Option, raw: Any) -> str:
    """A TOML value as the text its option parses: `phase_timeout = { eval = 600 }` reads as
    `eval=600`, a list as comma-separated values."""
    if isinstance(raw, dict):
        return ",".join(f"{k}={v}" for k, v in raw.items())
    if isinstance(raw, list):
        return ",".join(str(v) for v in raw)
    return str(raw)
