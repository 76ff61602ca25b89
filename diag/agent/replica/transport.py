"""Agent to agent over TCP: the client calls (push, offer, pull); the server is holder.py.

Why plain TCP between agents and not a torch process group of the agents: the agent does not
import torch (it must start in a fraction of a second and stay small next to the ranks), and a
process group lives and dies as a whole: the very event replicas exist for, a node lost, breaks
every collective of the group until all agents re-rendezvous. A connection per push or pull
involves two nodes only, fails alone, and needs nothing when a node comes back.

Every call authenticates both ways first (handshake.py): nothing the other end sends is believed
before it proved the job's token. Offers and pulls have a deadline over the whole call, not only
over each read, so a holder that dribbles its bytes cannot keep a restarting node waiting.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

from diag.agent.replica.deadline import cutoff
from diag.agent.replica.handshake import client_side
from diag.agent.replica.holder import ReplicaServer as ReplicaServer
from diag.agent.replica.pace import Pace
from diag.agent.replica.parts import send_part
from diag.agent.replica.peers import Address as Address
from diag.agent.replica.peers import Peers as Peers
from diag.agent.replica.source import LocalReplica, install
from diag.agent.replica.wire import (
    Kind,
    Manifest,
    OfferReply,
    Op,
    Result,
    manifest_body,
    parse_manifest,
    parse_offer,
    parse_result,
    recv,
    send,
)
from diag.formats.untrusted import Owners, UntrustedInput

AUTH_DEADLINE_S = 10.0  # connecting and the authentication, from the client's side
OFFER_DEADLINE_S = 10.0  # a whole offer: connect, authenticate, the answer


@contextlib.contextmanager
def _call(
    peers: Peers, holder: str, op: Op, *, timeout: float, deadline: float, whole: bool
) -> Iterator[socket.socket]:
    """A connection to `holder` for `op`, authenticated both ways (TLS first where configured):
    the setup within AUTH_DEADLINE_S, and with `whole` everything within `deadline`."""
    source = _source(peers, holder)
    raw = socket.create_connection(peers.address(holder), timeout=min(timeout, deadline))
    with contextlib.ExitStack() as stack:
        stack.callback(raw.close)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        limit = deadline if whole else min(deadline, AUTH_DEADLINE_S)
        what = f"the {op.value} with {source}" if whole else f"authenticating with {source}"
        c = stack.enter_context(cutoff(raw, limit, what))
        sock = raw
        if peers.tls is not None:
            sock = peers.tls.client.wrap_socket(raw, do_handshake_on_connect=False)
            stack.callback(sock.close)
            c.watch(sock)
            sock.do_handshake()
        client_side(sock, peers, holder, op, source)
        if not whole:
            c.cancel()  # a push then takes as long as its parts need
        yield sock


def _source(peers: Peers, holder: str) -> str:
    address = peers.address(holder)
    return f"replica holder {holder} ({address[0]}:{address[1]})"


def push(
    peers: Peers,
    holder: str,
    local: LocalReplica,
    owners: Owners,
    *,
    timeout: float = 30.0,
    pace: Pace | None = None,
) -> Result:
    """Sends this node's replica to `holder`, at most as fast as `pace` lets it; the holder's
    answer."""
    source = _source(peers, holder)
    with _call(peers, holder, Op.PUSH, timeout=timeout, deadline=timeout, whole=False) as sock:
        send(sock, Kind.MANIFEST, manifest_body(local.manifest))
        try:
            for part, path in zip(local.manifest.parts, local.paths, strict=True):
                send_part(sock, path, part, local.manifest.step, owners, lock_timeout=timeout,
                          pace=pace)  # fmt: skip
        except OSError:
            pass  # the holder may have refused and closed: its answer says why
        return parse_result(recv(sock, Kind.RESULT, source)[1], source)


def ask_offer(
    peers: Peers, holder: str, *, timeout: float = 5.0, deadline: float = OFFER_DEADLINE_S
) -> OfferReply:
    """What `holder` holds of this node, asked within `deadline` seconds in all."""
    source = _source(peers, holder)
    with _call(peers, holder, Op.OFFER, timeout=timeout, deadline=deadline, whole=True) as sock:
        kind, body = recv(sock, (Kind.OFFER, Kind.RESULT), source)
        if kind == Kind.RESULT:
            raise UntrustedInput(source, f"refused: {parse_result(body, source).error}")
        return parse_offer(body, source)


def pull(
    peers: Peers,
    holder: str,
    run_dir: Path,
    *,
    max_bytes: int,
    timeout: float = 30.0,
    deadline: float = 600.0,
) -> tuple[Manifest, list[Path]]:
    """Takes this node's replica from `holder` into its run directory as the ranks' slots, all of
    it within `deadline` seconds (DeadlineExceeded otherwise, and nothing installed)."""
    source = _source(peers, holder)
    with _call(peers, holder, Op.PULL, timeout=timeout, deadline=deadline, whole=True) as sock:
        kind, body = recv(sock, (Kind.MANIFEST, Kind.RESULT), source)
        if kind == Kind.RESULT:
            raise UntrustedInput(source, f"has nothing to give: {parse_result(body, source).error}")
        m = parse_manifest(body, source, max_part=max_bytes, max_total=max_bytes)
        if (m.node, m.job) != (peers.me, peers.job):
            raise UntrustedInput(source, f"sent node {m.node!r}'s replica of job {m.job!r}")
        return m, install(sock, m, run_dir, source, capacity_cap=max_bytes)
