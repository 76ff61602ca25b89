"""The agent's options: one table, each option a flag (`--hang-timeout`), an environment
variable (`DIAG_HANG_TIMEOUT`) and a key of the `[agent]` table of the `--config` TOML file;
their parsers, and the options of earlier versions that fail loudly. `config.load` reads them.
"""

from __future__ import annotations

import argparse
import enum
from pathlib import Path

from diag.agent.config.hangoptions import HANG_OPTIONS
from diag.agent.config.removed import REMOVED
from diag.agent.drain.notice import Provider
from diag.agent.drain.plan import DEFAULT_GRACE_S, DEFAULT_MARGIN_S
from diag.agent.metrics.prechecktext import DEFAULT_NAME as PRECHECK_FILE
from diag.agent.metrics.xputimer import PORT_ENV as XPU_TIMER_PORT_ENV
from diag.agent.optiontable.optiontable import (
    Bounds,
    Option,
    OptionTable,
    boolean,
    count,
    non_negative,
    positive,
    size,
)
from diag.agent.replica.settings import parse_nodes
from diag.agent.retention.policy import DEFAULT_INCIDENT_RETENTION
from diag.agent.taint import taintconfig

DEFAULT_TIMELINE = "/root/timeline"  # where xpu_timer writes, so DLRover users find it there


class Until(enum.Enum):
    FOREVER = "forever"  # a sidecar: run until the pod stops
    INCIDENT = "incident"  # exit after handling the first incident
    JOB_END = "job-end"  # exit when every local rank has ended


def parse_id(text: str) -> int:
    """A numeric user or group id."""
    value = int(text)
    if not 0 <= value < 2**32 - 1:
        raise ValueError(f"not a numeric user or group id: {text}")
    return value


def parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port < 65536:
        raise ValueError(f"not a TCP port: {text}")
    return port


OPTIONS = OptionTable(
    (
        Option(
            "run_dir",
            Path,
            None,
            "directory of the ranks' op journals (shared with the trainer; "
            "default: $DIAG_RUN_DIR, else /dev/shm/diag)",
        ),
        Option(
            "trainer_uid",
            parse_id,
            None,
            "numeric uid the ranks run as: files in the run directory owned by anyone but it, root "
            "and the agent's user are ignored, and only processes of those users are taken for "
            "ranks. An agent started as root becomes this user after start-up (a root helper "
            "keeps only the stack dumps) and refuses a run directory of any other user but root "
            "(default: root for a root agent, else the run directory's owner)",
        ),
        Option(
            "trainer_gid",
            parse_id,
            None,
            "numeric gid of the trainers: a run directory writable by its group is accepted only "
            "when the group is this one (every member is then trusted to write journals); a "
            "missing run directory is given to it",
        ),
        Option(
            "state_dir",
            Path,
            None,
            "the agent's own directory: its lock (one agent per run directory) and the replicas "
            "it holds for peers; nobody else may write it (default: /run/diag-agent as root, "
            "else /dev/shm/diag-agent-UID; in a pod, a volume of the agent's container alone)",
        ),
        Option("timeline", Path, Path(DEFAULT_TIMELINE), "where incident directories are written"),
        Option("job", str, None, "watch only journals of this job (default: all in the run dir)"),
        Option(
            "node",
            str,
            None,
            "this node's name in the job: in incidents, verdicts and --replica-nodes, the same "
            "as its ranks' (default: $DIAG_NODE, else $NODE_NAME, else the hostname); with "
            "replication, the worker's place in the job (e.g. worker-0), which a replacement keeps",
        ),
        *HANG_OPTIONS,
        Option("interval", positive, 0.5, "seconds between checks (deaths are seen at once)"),
        Option(
            "until", str, "forever", "when the agent exits", choices=tuple(m.value for m in Until)
        ),
        Option(
            "native_stacks", boolean, True, "include native frames in stack dumps (py-spy --native)"
        ),
        Option("pyspy_timeout", positive, 10.0, "seconds allowed for one stack dump"),
        Option(
            "dump_parallel",
            count,
            0,
            "stack dumps run at once (0: from the container's CPU quota); never more than its "
            "memory limit leaves room for",
        ),
        Option(
            "metrics_port",
            parse_port,
            None,
            "serve Prometheus metrics on this port (0: any free port)",
        ),
        Option("metrics_host", str, "0.0.0.0", "address the metrics server binds"),
        Option(
            "xpu_timer_compat",
            boolean,
            False,
            "also expose xpu_timer's XPU_TIMER_COMMON_HANG gauge, so DLRover's hang diagnosis acts "
            f"on our detection (metrics port defaults to ${XPU_TIMER_PORT_ENV}, which DLRover scrapes)",
        ),
        Option(
            "precheck_metrics",
            Path,
            None,
            "re-export this `diag precheck --metrics-file` textfile "
            f"(default: <run dir>/{PRECHECK_FILE})",
        ),
        Option(
            "control",
            boolean,
            True,
            "serve the control channel (commands, flash-checkpoint persists)",
        ),
        Option(
            "control_socket",
            Path,
            None,
            "unix socket of the control channel (default: <run dir>/<job>.control.sock, or "
            "<run dir>/diag.control.sock without --job)",
        ),
        Option(
            "persist_on_incident",
            boolean,
            True,
            "on a rank death or a hang, persist the newest flash checkpoints: before stopping the "
            "ranks, or right after asking them to recover in place (they keep their memory)",
        ),
        Option(
            "save_dir",
            Path,
            None,
            "where flash checkpoints are persisted (default: the save dir the trainer names; set it "
            "when storage is mounted elsewhere in the sidecar)",
        ),
        Option("keep_last", count, 3, "persisted steps to keep in the save dir (0: all)"),
        Option(
            "snapshot_linger",
            positive,
            300.0,
            "seconds to keep the in-memory checkpoints of a job whose ranks died (for a restart)",
        ),
        Option("persist_workers", count, 2, "threads writing checkpoints to storage"),
        Option(
            "replica_nodes",
            parse_nodes,
            None,
            "keep each node's newest flash checkpoint also in the memory of the next nodes of a "
            "ring: the job's nodes as NAME=HOST:PORT,... (NAME as --node names them, HOST:PORT "
            "where each node's agent listens for replicas), in the same order on every node; "
            "needs --job (default: no replicas)",
        ),
        Option(
            "replica_factor",
            count,
            1,
            "how many peer nodes hold each node's replica (the next ones in --replica-nodes)",
        ),
        Option(
            "replica_token",
            str,
            None,
            "a secret the job's agents share, at least 16 characters, needed with "
            "--replica-nodes: peers prove they hold it (never sending it) and one that does not "
            "is refused (set it through the environment, DIAG_REPLICA_TOKEN, not a flag others "
            "can read)",
        ),
        Option(
            "replica_max_bytes",
            size,
            64 << 30,
            "the most memory one peer's replica may take, e.g. 64GiB (the replica directory "
            "needs room for twice that per peer while a newer replica arrives)",
        ),
        Option(
            "replica_dir",
            Path,
            None,
            "where the replicas held for peers live (default: in --state-dir, where the trainer "
            "cannot reach them)",
        ),
        Option(
            "replica_interval",
            positive,
            0.25,
            "seconds between looks at the ranks' slot headers for a newer step to send (a step "
            "completed in between waits that long to leave the node)",
        ),
        Option("replica_listen", str, "0.0.0.0", "address the replica server binds"),
        Option(
            "replica_max_rate",
            size,
            0,
            "the most bytes per second this node's pushes of its replica may send, e.g. 500MB "
            "(they share the network with training; 0: no cap; a pull is never capped)",
        ),
        Option(
            "replica_lost_after",
            positive,
            5.0,
            "seconds a peer's agent must stay silent, once this node's ranks were stopped, before "
            "this node writes the replica it holds for that peer to storage (a lost node: the "
            "job can resume at a smaller size from that newer step); also, at most 10 s, before "
            "the job verdict names that peer as a node lost whole",
        ),
        Option(
            "replica_pull_deadline",
            positive,
            90.0,
            "seconds an empty node's restore from a peer may take in all (asking the holders, "
            "the pull); past them the ranks restore from storage (keep it under the 120 s the "
            "ranks wait for the pull)",
        ),
        Option(
            "replica_tls_cert",
            Path,
            None,
            "TLS between agents: this agent's certificate (PEM); with --replica-tls-key and "
            "--replica-tls-ca (default: plain TCP)",
        ),
        Option("replica_tls_key", Path, None, "TLS between agents: the certificate's key (PEM)"),
        Option(
            "replica_tls_ca",
            Path,
            None,
            "TLS between agents: the CA (PEM) that signed every agent's certificate; a peer "
            "without one is refused",
        ),
        Option(
            "drain",
            boolean,
            True,
            "on SIGTERM, drain: EXIT to the ranks, persist their newest checkpoint, then exit "
            "(false: stop at once)",
        ),
        Option(
            "termination_grace",
            positive,
            DEFAULT_GRACE_S,
            "seconds between SIGTERM and SIGKILL (the pod's terminationGracePeriodSeconds)",
        ),
        Option(
            "drain_margin",
            non_negative,
            DEFAULT_MARGIN_S,
            "seconds of the grace period the drain leaves unused, for the agent's own exit",
        ),
        Option(
            "preemption_notice",
            str,
            "none",
            "poll the cloud's metadata server for a reclaim notice and drain early",
            choices=tuple(m.value for m in Provider),
        ),
        Option(
            "notice_url",
            str,
            None,
            "the metadata URL polled (default: the provider's: AWS spot instance-action, GCE "
            "preempted)",
        ),
        Option("notice_interval", positive, 5.0, "seconds between polls of the metadata URL"),
        Option(
            "keep_incidents",
            count,
            DEFAULT_INCIDENT_RETENTION.count,
            "incident directories kept in the timeline, newest first (0: no count limit); the "
            "newest and the one being written are always kept",
        ),
        Option(
            "keep_incident_days",
            non_negative,
            DEFAULT_INCIDENT_RETENTION.max_age / 86400,
            "incident directories older than this many days are removed (0: no age limit)",
        ),
        Option(
            "keep_incident_bytes",
            size,
            DEFAULT_INCIDENT_RETENTION.max_bytes,
            "incident directories are removed, oldest first, beyond this total size, e.g. 2GiB "
            "(0: no size limit)",
        ),
    )
)

_DAY = 86400.0
_WEEK = 7 * _DAY
# The allowed range of each numeric option: nan, inf and values outside exit 2 (see optiontable).
BOUNDS = {
    "hang_timeout": Bounds(0, _WEEK, lo_open=True),
    "hang_floor": Bounds(0, _WEEK, lo_open=True),
    "hang_factor": Bounds(1, 1000),
    "idle_factor": Bounds(0, 1000),
    "warmup_steps": Bounds(0, 1_000_000),
    "warmup_timeout": Bounds(0, _WEEK, lo_open=True),
    "warmup_cadence": Bounds(0, _DAY),
    "default_phase_timeout": Bounds(0, _WEEK, lo_open=True),
    "stop_grace": Bounds(0, 3600, lo_open=True),
    "interval": Bounds(0, 600, lo_open=True),
    # The dump helper of a dropped agent refuses longer dumps (privilege.dumpwire.MAX_TIMEOUT).
    "pyspy_timeout": Bounds(0, 600, lo_open=True),
    "dump_parallel": Bounds(0, 1024),
    "metrics_port": Bounds(0, 65535),
    "keep_last": Bounds(0, 1_000_000),
    "replica_factor": Bounds(0, 64),
    "replica_max_bytes": Bounds(1 << 20, 1 << 50),
    "replica_interval": Bounds(0, 3600, lo_open=True),
    "replica_max_rate": Bounds(0, 1 << 50),
    "replica_lost_after": Bounds(0, 3600, lo_open=True),
    "replica_pull_deadline": Bounds(0, 3600, lo_open=True),
    "snapshot_linger": Bounds(0, _WEEK, lo_open=True),
    "persist_workers": Bounds(0, 256),
    "termination_grace": Bounds(0, _DAY, lo_open=True),
    "drain_margin": Bounds(0, 3600),
    "notice_interval": Bounds(0, 3600, lo_open=True),
    "keep_incidents": Bounds(0, 1_000_000),
    "keep_incident_days": Bounds(0, 36500),
    "keep_incident_bytes": Bounds(0, 1 << 50),
}
OPTIONS = OPTIONS.with_bounds(BOUNDS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        help="TOML file with an [agent] table (and a [taint] table, a [precheck] table)",
    )
    OPTIONS.add_arguments(parser, show_default=lambda d: "" if isinstance(d, dict) else str(d))
    for name in REMOVED:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, help=argparse.SUPPRESS)
    taintconfig.add_arguments(parser)
