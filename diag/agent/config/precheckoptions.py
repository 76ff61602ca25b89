"""`diag precheck`'s options: what to measure, the thresholds of a verdict and the timeouts, each a
flag (`--pair-seconds`), an environment variable (`DIAG_PRECHECK_PAIR_SECONDS`) and a key of the
`[precheck]` table of the `--config` TOML file, in that order; `settings` reads them once into a
`PrecheckSettings`. The rendezvous comes from flags or the launcher's own variables (MASTER_ADDR,
NNODES, ...) and the output from flags: the command passes them in.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diag.agent.node.units import parse_rate
from diag.agent.optiontable.optiontable import (
    Bounds,
    Option,
    OptionTable,
    count,
    finite,
    integer,
    positive,
    read_toml_table,
    size,
)
from diag.agent.precheck.grading import Thresholds
from diag.agent.precheck.precheckconfig import (
    DevicePairs,
    LocalCheck,
    Measure,
    PrecheckSettings,
    Rendezvous,
    Timeouts,
)
from diag.formats.exitcodes import UsageError

TOML_TABLE = "precheck"
_WEEK = 7 * 86400.0
_SECONDS = Bounds(0, 3600, lo_open=True)
_TIMEOUT = Bounds(0, _WEEK, lo_open=True)
_RATIO = Bounds(0, 1, lo_open=True)


def parse_checks(text: str) -> frozenset[LocalCheck]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    known = ", ".join(c.value for c in LocalCheck)
    try:
        checks = frozenset(LocalCheck(c) for c in names)
    except ValueError:
        raise ValueError(f"expected a comma-separated subset of {known}, got {text!r}") from None
    if not checks:
        raise ValueError(f"no check named: give a comma-separated subset of {known}")
    return checks


def parse_pairs(text: str) -> DevicePairs:
    return DevicePairs.parse(text)


def parse_rate_option(text: str) -> float:
    return parse_rate(str(text))


def _table(*options: Option) -> OptionTable:
    return OptionTable(options, toml_table=TOML_TABLE, env_prefix="PRECHECK_")


MEASURE = _table(
    Option(
        "checks",
        parse_checks,
        frozenset(LocalCheck),
        "comma-separated subset of device,compute,intra,inter",
    ),
    Option("device", str, "auto", "where the local checks run", choices=("auto", "cpu", "cuda")),
    Option("net_device", integer, 0, "local GPU for inter-node tests", bounds=Bounds(0, 1024)),
    Option(
        "msg_size",
        size,
        None,
        "allreduce size per pair (none: 8MiB on CPU, 64MiB on a GPU)",
        bounds=Bounds(8, None),
    ),
    Option("pair_seconds", positive, 1.0, "timed budget per pair", bounds=_SECONDS),
    Option("warmup_iters", count, 1, "untimed allreduces first", bounds=Bounds(0, 1_000_000)),
    Option("max_iters", integer, 50, "timed allreduces at most", bounds=Bounds(0, 1_000_000, True)),
    Option("max_rounds", integer, 5, "inter-node pairing rounds", bounds=Bounds(0, 1000, True)),
    Option(
        "matmul_size",
        integer,
        None,
        "matmul edge (none: 512 on CPU, 8192 on a GPU)",
        bounds=Bounds(16, 65536),
    ),
    Option("compute_seconds", positive, 1.0, "matmul budget", bounds=_SECONDS),
    Option("compute_threads", integer, 1, "CPU matmul threads", bounds=Bounds(0, 1024, True)),
    Option("copy_size", size, 256 << 20, "intra-node copy size", bounds=Bounds(1, None)),
    Option("device_pairs", parse_pairs, DevicePairs(), "intra-node pairs: ring, all or 0-1,2-3"),
)

THRESHOLDS = _table(
    Option(
        "straggler_ratio",
        finite,
        0.5,
        "a node whose best busbw is below this times the median is a straggler",
        bounds=_RATIO,
    ),
    Option(
        "min_busbw",
        parse_rate_option,
        None,
        "busbw floor for every link, e.g. 10GB/s or 100Mbit",
        bounds=Bounds(0, None, True),
    ),
    Option("compute_ratio", finite, 0.5, "below this times the median matmul", bounds=_RATIO),
    Option("copy_ratio", finite, 0.5, "below this times the median copy", bounds=_RATIO),
    Option(
        "min_copy_bw",
        parse_rate_option,
        None,
        "intra-node copy floor, e.g. 100GB/s",
        bounds=Bounds(0, None, True),
    ),
    Option(
        "max_gpu_memory_used", finite, 0.3, "fraction of GPU memory in use before", bounds=_RATIO
    ),
    Option("max_gpu_temp", finite, 85.0, "GPU temperature, degrees C", bounds=Bounds(0, 200)),
)

TIMEOUTS = _table(
    Option("rdzv_timeout", positive, 300.0, "seconds for all nodes to join", bounds=_TIMEOUT),
    Option("connect_timeout", positive, 30.0, "seconds for a pair to connect", bounds=_TIMEOUT),
    Option("collective_timeout", positive, 30.0, "seconds per allreduce", bounds=_TIMEOUT),
    Option("local_timeout", positive, 300.0, "seconds for the local checks", bounds=_TIMEOUT),
    Option(
        "lost_after", positive, 10.0, "seconds after which a silent node is gone", bounds=_TIMEOUT
    ),
    Option("heartbeat", positive, 1.0, "seconds between heartbeats", bounds=_SECONDS),
)

TABLES = (MEASURE, THRESHOLDS, TIMEOUTS)


def shown(value: Any) -> str:
    """A default as the user would write it."""
    if value is None:
        return "none"
    if isinstance(value, frozenset):
        return ",".join(c.value for c in LocalCheck if c in value)
    if isinstance(value, DevicePairs):
        return value.text()
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20}MiB"  # the sizes: as they are written
    return str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for title, table in (
        ("what to measure", MEASURE),
        ("thresholds", THRESHOLDS),
        ("timeouts (seconds)", TIMEOUTS),
    ):
        table.add_arguments(parser.add_argument_group(title), show_default=shown)


def _from_file(opt: Option, value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool | dict):
        raise UsageError(f"[{TOML_TABLE}] {opt.name}: expected a number or a string")
    return str(value)


def settings(
    args: argparse.Namespace,
    rdzv: Rendezvous,
    job: str,
    env: Mapping[str, str] = os.environ,
    config: Path | None = None,
) -> PrecheckSettings:
    """The options (flag > environment > `[precheck]` of `config` > default), checked together."""
    known = [o.name for t in TABLES for o in t.options]
    file_values = read_toml_table(config, TOML_TABLE, known) if config else {}
    values: dict[str, Any] = {}
    for table in TABLES:
        values.update(table.resolve(args, env, file_values, config, from_file=_from_file))
    if values["heartbeat"] * 2 > values["lost_after"]:
        raise UsageError(
            f"--lost-after {values['lost_after']:g} must be at least twice --heartbeat "
            f"{values['heartbeat']:g}: a node would be given up between two heartbeats"
        )
    return PrecheckSettings(
        rdzv=rdzv,
        job=job,
        timeouts=Timeouts(
            rdzv_s=values["rdzv_timeout"],
            connect_s=values["connect_timeout"],
            collective_s=values["collective_timeout"],
            local_s=values["local_timeout"],
            lost_after_s=values["lost_after"],
            heartbeat_s=values["heartbeat"],
        ),
        measure=Measure(
            device=values["device"],
            msg_bytes=values["msg_size"],
            pair_seconds=values["pair_seconds"],
            warmup_iters=values["warmup_iters"],
            max_iters=values["max_iters"],
            matmul_size=values["matmul_size"],
            compute_seconds=values["compute_seconds"],
            compute_threads=values["compute_threads"],
            copy_bytes=values["copy_size"],
            device_pairs=values["device_pairs"],
            net_device=values["net_device"],
            checks=values["checks"],
        ),
        thresholds=Thresholds(
            straggler_ratio=values["straggler_ratio"],
            min_busbw=values["min_busbw"],
            compute_ratio=values["compute_ratio"],
            copy_ratio=values["copy_ratio"],
            min_copy_bw=values["min_copy_bw"],
            max_gpu_memory_used=values["max_gpu_memory_used"],
            max_gpu_temp_c=values["max_gpu_temp"],
        ),
        max_rounds=values["max_rounds"],
    )
