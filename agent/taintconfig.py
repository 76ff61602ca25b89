"""Taint settings, read once at the entry point (`diag agent`, `diag taint`, `diag untaint`):
flags > environment > the `[taint]` table of the `--config` TOML file > default.

Each option `NAME` has the flag `--taint-NAME` and the variable `DIAG_TAINT_NAME` (`job_cap`:
`--taint-job-cap`, `DIAG_TAINT_JOB_CAP`, `job_cap = 2` in `[taint]`). The node-health monitors'
options (`watch_nics`, ...) are the agent's only: the commands take their evidence as flags.
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

from diag.agent.exitcodes import UsageError
from diag.agent.nodehealth import HealthSettings
from diag.agent.taintmodel import APPLICATION_XIDS, HARDWARE_XIDS, TaintPolicy


class TaintMode(enum.StrEnum):
    OFF = "off"
    DRY_RUN = "dry-run"  # plan and log, change nothing
    ON = "on"


@dataclass(frozen=True)
class TaintSettings:
    mode: TaintMode = TaintMode.OFF
    policy: TaintPolicy = field(default_factory=TaintPolicy)
    event_namespace: str = "default"
    retries: int = 5  # conflict retries on the node's resourceVersion
    kubeconfig: str | None = None  # None: $KUBECONFIG, else the in-cluster service account
    ledger_timeout: float = 30.0
    health: HealthSettings = field(default_factory=HealthSettings)


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"must be >= 0 seconds, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(f"must be > 0 seconds, got {text}")
    return value


def _names(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip() for p in str(text).split(",") if p.strip()))
    bad = [n for n in names if "/" in n or len(n) > 15]
    if bad:
        raise ValueError(f"not an interface name: {', '.join(bad)} (expected e.g. eth0,ib0)")
    return names


def _path(text: str) -> Path | None:
    return Path(text) if text else None


def _xids(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(p) for p in str(text).replace(" ", "").split(",") if p}))
    except ValueError as e:
        raise ValueError(f"expected XID numbers separated by commas, got {text!r}") from e


def _bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class _Opt:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    agent_only: bool = False  # a node-health monitor's option: not for `diag taint`/`untaint`

    @property
    def flag(self) -> str:
        return "--taint-" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "DIAG_TAINT_" + self.name.upper()


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


OPTIONS = (
    _Opt(
        "mode",
        str,
        "off",
        "the agent taints its own node when it is named culprit or its hardware fails: off, "
        "dry-run (log the plan) or on",
        choices=tuple(m.value for m in TaintMode),
    ),
    _Opt("culprit_threshold", _count, 3, "taint after this many incidents naming this node"),
    _Opt("culprit_window", _seconds, 86400.0, "... within this many seconds"),
    _Opt("no_execute", _bool, False, "also NoExecute for confirmed hardware faults"),
    _Opt("expiry", _seconds, 86400.0, "seconds a taint lasts without new evidence (0: forever)"),
    _Opt("job_cap", _count, 2, "nodes one job may hold tainted at once"),
    _Opt("rate_count", _count, 1, "new taints one job may make ..."),
    _Opt("rate_window", _seconds, 600.0, "... per this many seconds"),
    _Opt("ignore_xids", _xids, APPLICATION_XIDS, "application-caused XIDs that never taint"),
    _Opt("hardware_xids", _xids, HARDWARE_XIDS, "XIDs that are hardware faults (NoExecute)"),
    _Opt("event_namespace", str, None, "namespace of the Events (default: $POD_NAMESPACE)"),
    _Opt("retries", _count, 5, "retries when another writer changed the node meanwhile"),
    _Opt("kubeconfig", str, None, "kubeconfig file (default: $KUBECONFIG, else in-cluster)"),
    _Opt(
        "watch_nics",
        _names,
        (),
        "watch these interfaces' carrier (comma-separated, e.g. eth0,ib0): a NIC without "
        "carrier taints",
        agent_only=True,
    ),
    _Opt(
        "nic_grace",
        _seconds,
        10.0,
        "seconds a NIC must stay without carrier before it counts",
        agent_only=True,
    ),
    _Opt(
        "precheck_report",
        _path,
        None,
        "watch this `diag precheck --report` file: a faulty verdict for this node taints, a "
        "clean one clears the taint",
        agent_only=True,
    ),
    _Opt(
        "gpu_watch",
        _bool,
        True,
        "watch NVML for critical XID events and uncorrected ECC errors (skipped without a driver)",
        agent_only=True,
    ),
    _Opt(
        "health_interval",
        _positive,
        10.0,
        "seconds between looks at the node's health",
        agent_only=True,
    ),
)


def add_arguments(parser: argparse.ArgumentParser, agent: bool = True) -> None:
    """The options of `diag agent` (`agent`), else of `diag taint` and `diag untaint`."""
    group = parser.add_argument_group("node taints")
    for opt in OPTIONS:
        if (opt.name == "mode" or opt.agent_only) and not agent:
            continue
        default = _csv(opt.default) if isinstance(opt.default, tuple) else opt.default
        default = "none" if default in ("", None) else default
        group.add_argument(
            opt.flag,
            dest=f"taint_{opt.name}",
            default=None,
            choices=opt.choices,
            help=f"{opt.help} [env {opt.env}; default {default}]",
        )


def load(
    args: argparse.Namespace,
    *,
    job: str | None,
    env: Mapping[str, str] = os.environ,
    config: Path | None = None,
) -> TaintSettings:
    file_values = _read_file(config) if config else {}
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw, source = getattr(args, f"taint_{opt.name}", None), opt.flag
        if raw is None and opt.env in env:
            raw, source = env[opt.env], opt.env
        if raw is None and opt.name in file_values:
            raw, source = file_values[opt.name], f"{config}: [taint] {opt.name}"
        if raw is None:
            values[opt.name] = opt.default
            continue
        if isinstance(raw, list):
            raw = ",".join(str(v) for v in raw)
        if opt.choices and str(raw) not in opt.choices:
            raise UsageError(f"{source}: {raw!r} is not one of {', '.join(opt.choices)}")
        try:
            values[opt.name] = opt.parse(str(raw))
        except ValueError as e:
            raise UsageError(f"{source}: {e}") from e
    policy = TaintPolicy(
        culprit_threshold=values["culprit_threshold"],
        culprit_window=values["culprit_window"],
        ignore_xids=values["ignore_xids"],
        hardware_xids=values["hardware_xids"],
        no_execute=values["no_execute"],
        expiry=values["expiry"],
        job_cap=values["job_cap"],
        rate_count=values["rate_count"],
        rate_window=values["rate_window"],
        job=job or "",
    )
    return TaintSettings(
        mode=TaintMode(values["mode"]),
        policy=policy,
        event_namespace=values["event_namespace"] or env.get("POD_NAMESPACE") or "default",
        retries=values["retries"],
        kubeconfig=values["kubeconfig"],
        health=HealthSettings(
            nics=values["watch_nics"],
            nic_grace=values["nic_grace"],
            precheck_report=values["precheck_report"],
            gpu=values["gpu_watch"],
            interval=values["health_interval"],
        ),
    )


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise UsageError(f"--config {path}: no such file") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from e
    table = raw.get("taint", {})
    if not isinstance(table, dict):
        raise UsageError(f"--config {path}: [taint] must be a table")
    known = {o.name for o in OPTIONS}
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in known:
            raise UsageError(f"--config {path}: unknown option {key!r} in [taint]")
        out[name] = value
    return out
