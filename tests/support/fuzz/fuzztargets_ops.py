"""Fuzz targets of the agent's own configuration: the `--config` TOML file as `diag agent` reads
it (its `[agent]` and `[taint]` tables), and as `diag taint` reads its `[taint]` table. A bad
file is refused with a UsageError (exit 2) naming it, or an UntrustedInput; never a traceback.

`diag precheck` takes no config file (flags and the launcher's environment only)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fuzzkit import FuzzTarget

from diag.agent.config import agentconfig as config
from diag.agent.taint import taintconfig
from diag.cli import taintcmd
from diag.formats.exitcodes import UsageError
from diag.formats.untrusted import UntrustedInput

REFUSALS = (UsageError, UntrustedInput)

_AGENT = b"""\
[agent]
hang_timeout = 120
hang_floor = 5.5
hang_factor = 4
warmup_steps = 3
interval = 0.25
phase_timeout = { eval = 600, save = 300 }
on_hang = "none"
until = "incident"
metrics_port = 9400
keep_incidents = 20
keep_incident_days = 7
keep_incident_bytes = "1GiB"
native_stacks = false

[taint]
mode = "dry-run"
culprit_threshold = 2
ignore_xids = [13, 31, 43]
watch_nics = ["eth0", "ib0"]
keep_history = 100
history_days = 3.5
"""

_TOP = b"""\
hang_timeout = 60
interval = 1
drain = true
termination_grace = 45
drain_margin = 5
"""

_TAINT = b"""\
[taint]
job_cap = 3
rate_count = 2
rate_window = 900
expiry = 0
retries = 4
event_namespace = "training"
"""


def _agent_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p


def _taint_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    taintcmd.add_arguments(p)
    return p


_AGENT_PARSER = _agent_parser()
_TAINT_PARSER = _taint_parser()


def _load_agent(path: Path) -> object:
    return config.load(_AGENT_PARSER.parse_args(["--config", str(path)]), env={})


def _load_taint(path: Path) -> object:
    args = _TAINT_PARSER.parse_args(["--config", str(path)])
    return taintconfig.load(args, job="job", env={}, config=args.config)


TARGETS = [
    FuzzTarget(
        name="agent_config",
        seeds=lambda d: [_AGENT, _TOP, _TAINT],
        parse=_load_agent,
        refusals=REFUSALS,
        file_name="agent.toml",
    ),
    FuzzTarget(
        name="taint_config",
        seeds=lambda d: [_TAINT, _AGENT],
        parse=_load_taint,
        refusals=REFUSALS,
        file_name="taint.toml",
    ),
]
