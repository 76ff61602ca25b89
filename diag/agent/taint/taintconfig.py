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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.agent.optiontable.optiontable import (
    Bounds,
    Option,
    OptionTable,
    boolean,
    count,
    non_negative,
    positive,
    read_toml_table,
)
from diag.agent.retention.policy import DEFAULT_HISTORY_RETENTION, Retention
from diag.agent.taint.model import APPLICATION_XIDS, HARDWARE_XIDS, TaintPolicy


# The settings of the node-health monitors (agent.health), here because they are taint options
# (`--taint-watch-nics`): health reads them, taint does not depend on health.
@dataclass(frozen=True)
class HealthSettings:
    """What the agent watches on its node (`--taint-watch-nics`, `--taint-precheck-report`,
    `--taint-gpu-watch`), and how often it looks."""

    nics: tuple[str, ...] = ()
    nic_grace: float = 10.0  # seconds without carrier before it counts
    precheck_report: Path | None = None
    gpu: bool = True  # NVML XIDs and ECC, where there is a driver
    interval: float = 10.0  # seconds between looks
    ecc_interval: float = 30.0


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
    kube_node: str = ""  # the Kubernetes node tainted ("": the agent's --node)
    health: HealthSettings = field(default_factory=HealthSettings)
    history: Retention = DEFAULT_HISTORY_RETENTION  # of the job's taint history in the ledger


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


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


OPTIONS = OptionTable(
    (
        Option(
            "mode",
            str,
            "off",
            "the agent taints its own node when it is named culprit or its hardware fails: off, "
            "dry-run (log the plan) or on",
            choices=tuple(m.value for m in TaintMode),
        ),
        Option("culprit_threshold", count, 3, "taint after this many incidents naming this node"),
        Option("culprit_window", non_negative, 86400.0, "... within this many seconds"),
        Option("no_execute", boolean, False, "also NoExecute for confirmed hardware faults"),
        Option(
            "expiry",
            non_negative,
            86400.0,
            "seconds a taint lasts without new evidence (0, or over 604800: 604800, 7 days)",
        ),
        Option("job_cap", count, 2, "nodes one job may hold tainted at once"),
        Option("rate_count", count, 1, "new taints one job may make ..."),
        Option("rate_window", non_negative, 600.0, "... per this many seconds"),
        Option("ignore_xids", _xids, APPLICATION_XIDS, "application-caused XIDs that never taint"),
        Option("hardware_xids", _xids, HARDWARE_XIDS, "XIDs that are hardware faults (NoExecute)"),
        Option("event_namespace", str, None, "namespace of the Events (default: $POD_NAMESPACE)"),
        Option("retries", count, 5, "retries when another writer changed the node meanwhile"),
        Option("kubeconfig", str, None, "kubeconfig file (default: $KUBECONFIG, else in-cluster)"),
        Option(
            "kube_node",
            str,
            None,
            "the Kubernetes node to taint, the one the pod runs on (default: $NODE_NAME, from "
            "the downward API's spec.nodeName, else --node); --node may then name the worker's "
            "place in the job, which a replacement keeps",
            agent_only=True,
        ),
        Option(
            "watch_nics",
            _names,
            (),
            "watch these interfaces' carrier (comma-separated, e.g. eth0,ib0): a NIC without "
            "carrier taints",
            agent_only=True,
        ),
        Option(
            "nic_grace",
            non_negative,
            10.0,
            "seconds a NIC must stay without carrier before it counts",
            agent_only=True,
        ),
        Option(
            "precheck_report",
            _path,
            None,
            "watch this `diag precheck --report` file: a faulty verdict for this node taints, a "
            "clean one clears the taint",
            agent_only=True,
        ),
        Option(
            "gpu_watch",
            boolean,
            True,
            "watch NVML for critical XID events and uncorrected ECC errors (skipped without a driver)",
            agent_only=True,
        ),
        Option(
            "health_interval",
            positive,
            10.0,
            "seconds between looks at the node's health",
            agent_only=True,
        ),
        Option(
            "keep_history",
            count,
            DEFAULT_HISTORY_RETENTION.count,
            "lines of the job's taint history kept (0: no count limit; never fewer than "
            "--taint-rate-count)",
        ),
        Option(
            "history_days",
            non_negative,
            DEFAULT_HISTORY_RETENTION.max_age / 86400,
            "days the job's taint history keeps a line (0: no age limit; never less than "
            "--taint-rate-window)",
        ),
    ),
    prefix="taint_",
    toml_table="taint",
).with_bounds(
    {
        "culprit_threshold": Bounds(0, 1_000_000),
        "culprit_window": Bounds(0, 365 * 86400),
        "expiry": Bounds(0, 365 * 86400),
        "job_cap": Bounds(0, 1_000_000),
        "rate_count": Bounds(0, 1_000_000),
        "rate_window": Bounds(0, 365 * 86400),
        "retries": Bounds(0, 1000),
        "nic_grace": Bounds(0, 86400),
        "health_interval": Bounds(0, 3600, lo_open=True),
        "keep_history": Bounds(0, 1_000_000),
        "history_days": Bounds(0, 36500),
    }
)


def add_arguments(parser: argparse.ArgumentParser, agent: bool = True) -> None:
    """The options of `diag agent` (`agent`), else of `diag taint` and `diag untaint`."""

    def shown(default: Any) -> str:
        text = _csv(default) if isinstance(default, tuple) else default
        return "none" if text in ("", None) else str(text)

    OPTIONS.add_arguments(
        parser.add_argument_group("node taints"),
        show_default=shown,
        keep=lambda o: agent or not (o.name == "mode" or o.agent_only),
    )


def load(
    args: argparse.Namespace,
    *,
    job: str | None,
    env: Mapping[str, str] = os.environ,
    config: Path | None = None,
) -> TaintSettings:
    known = [o.name for o in OPTIONS.options]
    file_values = read_toml_table(config, "taint", known) if config else {}
    values = OPTIONS.resolve(args, env, file_values, config)
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
        kube_node=values["kube_node"] or env.get("NODE_NAME") or "",
        health=HealthSettings(
            nics=values["watch_nics"],
            nic_grace=values["nic_grace"],
            precheck_report=values["precheck_report"],
            gpu=values["gpu_watch"],
            interval=values["health_interval"],
        ),
        history=_history(values),
    )


def _history(values: dict[str, Any]) -> Retention:
    """The history's retention, never shorter than the rate limit that reads it."""
    keep, days = values["keep_history"], values["history_days"]
    return Retention(
        count=max(keep, values["rate_count"]) if keep else 0,
        max_age=max(days * 86400.0, values["rate_window"]) if days else 0.0,
        max_bytes=DEFAULT_HISTORY_RETENTION.max_bytes,
    )
