"""The settings of replication, as the agent's options give them: the job's nodes (name and where
each agent listens, in one order on every node), the factor, the token, the caps, the deadlines,
TLS."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from diag.agent.replica.tls import TlsFiles
from diag.formats.refusals import MIB

MAX_NODES = 65536
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}$")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.:-]{1,253})$")


@dataclass(frozen=True)
class NodeAddress:
    name: str
    host: str
    port: int


@dataclass(frozen=True)
class ReplicaSettings:
    nodes: tuple[NodeAddress, ...]  # the job's nodes, in the ring's order
    # the job's secret, which every agent proves it holds (never sent, never in a log line)
    token: str = field(repr=False)
    factor: int = 1
    max_bytes: int = 65536 * MIB  # one peer's replica, all its ranks
    directory: Path | None = None  # None: <run dir>/.replicas
    interval: float = 0.25  # between looks at the slot headers (a few bytes each)
    listen_host: str = "0.0.0.0"
    timeout: float = 30.0  # a connection silent this long fails
    max_rate: int = 0  # bytes per second pushes may take of the network; 0: no cap
    lost_after: float = 5.0  # a peer silent this long after an incident: its replica to storage
    # An empty node's whole restore (offers and pull) ends by then: storage instead. Below the
    # 120 s ranks wait for the pull (trainer.flash.restore.PULL_WAIT_S), or they would not wait.
    pull_deadline: float = 90.0
    tls: TlsFiles | None = None  # TLS between agents; None: plain TCP


def parse_nodes(text: str) -> tuple[NodeAddress, ...]:
    """`NAME=HOST:PORT[,NAME=HOST:PORT...]`, e.g. `worker-0=10.0.0.5:7070,worker-1=w1.svc:7070`
    (an IPv6 host in brackets). ValueError naming the entry that is not one."""
    out: list[NodeAddress] = []
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if len(entries) > MAX_NODES:
        raise ValueError(f"{len(entries)} nodes, over {MAX_NODES}")
    for entry in entries:
        name, sep, where = entry.partition("=")
        host, colon, port = where.rpartition(":")
        if not sep or not colon or not _NAME.match(name) or not _HOST.match(host):
            raise ValueError(f"{entry[:80]!r} is not NAME=HOST:PORT")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{entry[:80]!r}: {port[:10]!r} is not a TCP port")
        out.append(NodeAddress(name, host.strip("[]"), int(port)))
    names = [n.name for n in out]
    if len(set(names)) != len(names):
        raise ValueError("a node is named twice")
    return tuple(out)
