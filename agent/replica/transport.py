"""Agent to agent over TCP: the server that holds peers' replicas, and the client calls.

Why plain TCP between agents and not a torch process group of the agents: the agent does not
import torch (it must start in a fraction of a second and stay small next to the ranks), and a
process group lives and dies as a whole: the very event replicas exist for, a node lost, breaks
every collective of the group until all agents re-rendezvous. A connection per push or pull
involves two nodes only, fails alone, and needs nothing when a node comes back.

Who may do what (everything else is refused and the connection dropped):
- every connection presents the job's replica token (when one is set) and a node name of the
  ring, from an address that name resolves to;
- push: only a node this one holds replicas for (Ring.held_by), only its own replica, for this
  job, at most the store's cap;
- offer and pull: only the node whose replica it is.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from diag.agent.replica.pace import Pace
from diag.agent.replica.parts import PartError, send_part
from diag.agent.replica.ring import Ring
from diag.agent.replica.source import LocalReplica, install
from diag.agent.replica.store import ReplicaStore, StoreBusy
from diag.agent.replica.wire import (
    Hello,
    Kind,
    Manifest,
    OfferReply,
    Op,
    Result,
    hello_body,
    manifest_body,
    offer_body,
    parse_hello,
    parse_manifest,
    parse_offer,
    parse_result,
    recv,
    result_body,
    send,
)
from diag.formats.snapshot import ShmSpaceError
from diag.formats.untrusted import Owners, UntrustedInput

log = logging.getLogger(__name__)

Address = tuple[str, int]
IDLE_TIMEOUT_S = 30.0  # a peer silent this long in the middle of a frame or a part is dropped
MAX_CONNECTIONS = 64  # at once; more are closed unanswered (a peer opening many is not served)


@dataclass(frozen=True)
class Peers:
    """The job's nodes: name -> where its agent listens, and the ring over them."""

    ring: Ring
    addresses: Mapping[str, Address]
    me: str
    job: str
    token: str = ""

    def address(self, node: str) -> Address:
        return self.addresses[node]

    def hello(self, op: Op) -> Hello:
        return Hello(op, self.me, self.job, self.token)


def _resolve(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # a restarted agent binds its port again at once
    daemon_threads = True


class ReplicaServer:
    """Serves pushes, offers and pulls on a listening socket, one thread per connection."""

    def __init__(
        self,
        store: ReplicaStore,
        peers: Peers,
        listen: Address,
        *,
        on_event: Callable[[str, str], None] | None = None,
    ) -> None:
        self.store = store
        self.peers = peers
        self.on_event = on_event or (lambda kind, detail: None)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._serve(self.request, self.client_address)

        self._tcp = _Server(listen, Handler)
        self._thread = threading.Thread(
            target=self._tcp.serve_forever, name="replica-server", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._tcp.server_address[1])

    def start(self) -> ReplicaServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._tcp.shutdown()
        self._tcp.server_close()
        self._thread.join(10)

    def _serve(self, sock: socket.socket, peer: Address) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("replica peer %s:%d: over %d connections, closed", *peer, MAX_CONNECTIONS)
            return
        try:
            self._serve_one(sock, peer)
        finally:
            self._slots.release()

    def _serve_one(self, sock: socket.socket, peer: Address) -> None:
        source = f"replica peer {peer[0]}:{peer[1]}"
        sock.settimeout(IDLE_TIMEOUT_S)
        try:
            hello = parse_hello(recv(sock, Kind.HELLO, source)[1], source)
            self._admit(hello, peer[0], source)
            if hello.op == Op.PUSH:
                self._push(sock, hello, source)
            elif hello.op == Op.OFFER:
                held = self.store.held(hello.node)
                send(sock, Kind.OFFER, offer_body(held.offer() if held else OfferReply(None)))
            else:
                self._pull(sock, hello, source)
        except UntrustedInput as e:
            log.warning("refused: %s", e)
            self.on_event("refused", str(e))
            with contextlib.suppress(OSError):
                send(sock, Kind.RESULT, result_body(Result(False, str(e))))
        except (OSError, StoreBusy, ShmSpaceError, ValueError) as e:
            log.warning("%s: %s", source, e)
            self.on_event("failed", str(e))
            with contextlib.suppress(OSError):
                send(sock, Kind.RESULT, result_body(Result(False, str(e))))

    def _admit(self, hello: Hello, ip: str, source: str) -> None:
        p = self.peers
        if p.token and not hmac.compare_digest(hello.token.encode(), p.token.encode()):
            raise UntrustedInput(source, "presented a wrong replica token")
        if hello.job != p.job:
            raise UntrustedInput(source, f"is of job {hello.job!r}, not {p.job!r}")
        if hello.node not in p.ring.nodes or hello.node == p.me:
            raise UntrustedInput(source, f"names node {hello.node!r}, not a peer of the ring")
        if ip not in _resolve(p.address(hello.node)[0]):
            raise UntrustedInput(source, f"is not at an address of node {hello.node!r}")
        if hello.op == Op.PUSH and hello.node not in p.ring.held_by(p.me):
            raise UntrustedInput(source, f"node {hello.node!r} is not one {p.me} holds replicas of")

    def _push(self, sock: socket.socket, hello: Hello, source: str) -> None:
        cap = self.store.max_bytes
        m = parse_manifest(
            recv(sock, Kind.MANIFEST, source)[1], source, max_part=cap, max_total=cap
        )
        if (m.node, m.job) != (hello.node, hello.job):
            raise UntrustedInput(source, f"pushed node {m.node!r}'s replica as {hello.node!r}")
        self.store.receive(m, sock, source)
        send(sock, Kind.RESULT, result_body(Result(True)))
        self.on_event("received", f"{m.node} step {m.step}")

    def _pull(self, sock: socket.socket, hello: Hello, source: str) -> None:
        held = self.store.held(hello.node)
        if held is None:
            send(sock, Kind.RESULT, result_body(Result(False, f"no replica of {hello.node}")))
            return
        send(sock, Kind.MANIFEST, manifest_body(held.manifest))
        for part in held.manifest.parts:
            try:
                send_part(sock, held.part_path(part), part, held.manifest.step,
                          self.store.owners, lock_timeout=1.0)  # fmt: skip
            except PartError as e:  # dropped by a newer push meanwhile: the client sees it cut
                raise OSError(str(e)) from None
        self.on_event("served", f"{hello.node} step {held.manifest.step}")


# -- the client ------------------------------------------------------------------------------------


def _connect(address: Address, timeout: float) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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
    address = peers.address(holder)
    source = f"replica holder {holder} ({address[0]}:{address[1]})"
    with _connect(address, timeout) as sock:
        send(sock, Kind.HELLO, hello_body(peers.hello(Op.PUSH)))
        send(sock, Kind.MANIFEST, manifest_body(local.manifest))
        try:
            for part, path in zip(local.manifest.parts, local.paths, strict=True):
                send_part(sock, path, part, local.manifest.step, owners, lock_timeout=timeout,
                          pace=pace)  # fmt: skip
        except OSError:
            pass  # the holder may have refused and closed: its answer says why
        return parse_result(recv(sock, Kind.RESULT, source)[1], source)


def ask_offer(peers: Peers, holder: str, *, timeout: float = 5.0) -> OfferReply:
    address = peers.address(holder)
    source = f"replica holder {holder} ({address[0]}:{address[1]})"
    with _connect(address, timeout) as sock:
        send(sock, Kind.HELLO, hello_body(peers.hello(Op.OFFER)))
        kind, body = recv(sock, (Kind.OFFER, Kind.RESULT), source)
        if kind == Kind.RESULT:
            raise UntrustedInput(source, f"refused: {parse_result(body, source).error}")
        return parse_offer(body, source)


def pull(
    peers: Peers, holder: str, run_dir: Path, *, max_bytes: int, timeout: float = 30.0
) -> tuple[Manifest, list[Path]]:
    """Takes this node's replica from `holder` into its run directory as the ranks' slots."""
    address = peers.address(holder)
    source = f"replica holder {holder} ({address[0]}:{address[1]})"
    with _connect(address, timeout) as sock:
        send(sock, Kind.HELLO, hello_body(peers.hello(Op.PULL)))
        kind, body = recv(sock, (Kind.MANIFEST, Kind.RESULT), source)
        if kind == Kind.RESULT:
            raise UntrustedInput(source, f"has nothing to give: {parse_result(body, source).error}")
        m = parse_manifest(body, source, max_part=max_bytes, max_total=max_bytes)
        if (m.node, m.job) != (peers.me, peers.job):
            raise UntrustedInput(source, f"sent node {m.node!r}'s replica of job {m.job!r}")
        return m, install(sock, m, run_dir, source, capacity_cap=max_bytes)
