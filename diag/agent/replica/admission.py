"""Who the replica server keeps waiting, and whom it serves: the decisions behind its bounds.

Before a connection has proven the job's token it costs the holder a thread and a socket and
gives nothing back, so it gets little: a deadline from accept for the whole authentication
(HELLO, CHALLENGE, AUTH, and the TLS handshake where TLS is on), and a bound on how many may wait
at once, the oldest dropped to make room. So connections that send a byte now and then
(slow-loris) cannot keep a real peer out: each is dropped at its deadline, or sooner when newer
ones arrive. A connection that proved the token is a node of the job: it may hold a few
connections at once, and all of them together are bounded too.

Pure: the caller passes the time and acts on the verdicts (agent.replica.holder).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    auth_deadline: float = 10.0  # seconds from accept to a proven token
    max_pending: int = 32  # connections waiting to authenticate, at once
    max_per_peer: int = 4  # authenticated connections of one node, at once
    max_authenticated: int = 64  # authenticated connections in all, at once

    def __post_init__(self) -> None:
        if not self.auth_deadline > 0 or min(self.max_pending, self.max_per_peer) < 1:
            raise ValueError(f"replica server limits out of range: {self}")
        if self.max_authenticated < self.max_per_peer:
            raise ValueError(f"replica server limits out of range: {self}")


@dataclass(frozen=True)
class Pending:
    """A connection not authenticated yet."""

    key: int
    accepted_at: float


def to_drop(pending: Sequence[Pending], now: float, limits: Limits) -> list[int]:
    """The connections to drop now: those past their deadline, then the oldest of the others
    beyond the bound."""
    overdue = [p for p in pending if now - p.accepted_at >= limits.auth_deadline]
    gone = {p.key for p in overdue}
    waiting = sorted((p for p in pending if p.key not in gone), key=lambda p: p.accepted_at)
    excess = max(0, len(waiting) - limits.max_pending)
    return [p.key for p in overdue] + [p.key for p in waiting[:excess]]


def next_deadline(pending: Sequence[Pending], limits: Limits) -> float | None:
    """When the oldest waiting connection runs out of time (None: nobody waits)."""
    if not pending:
        return None
    return min(p.accepted_at for p in pending) + limits.auth_deadline


def refusal(peer: str, per_peer: Mapping[str, int], limits: Limits) -> str | None:
    """Why an authenticated connection of node `peer` is not served (None: it is), given the
    authenticated connections served now, per node."""
    if per_peer.get(peer, 0) >= limits.max_per_peer:
        return f"node {peer} has {limits.max_per_peer} connections open already"
    if sum(per_peer.values()) >= limits.max_authenticated:
        return f"{limits.max_authenticated} connections are served already"
    return None
