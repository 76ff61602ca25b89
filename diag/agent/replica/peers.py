"""The job's nodes as one agent sees them: names, addresses, the ring, and what this agent proves
itself with (the job's token, TLS where configured)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from diag.agent.replica.ring import Ring
from diag.agent.replica.tls import Tls

Address = tuple[str, int]


@dataclass(frozen=True)
class Peers:
    """The job's nodes: name -> where its agent listens, and the ring over them."""

    ring: Ring
    addresses: Mapping[str, Address]
    me: str
    job: str
    token: str = field(repr=False)  # never in a log line
    tls: Tls | None = None

    def __post_init__(self) -> None:
        if not self.token:
            # no token, no replicas: a replica is a node's checkpoint, for its own agents only
            raise ValueError("replication needs the job's replica token")

    def address(self, node: str) -> Address:
        return self.addresses[node]

    @property
    def secret(self) -> bytes:
        return self.token.encode()
