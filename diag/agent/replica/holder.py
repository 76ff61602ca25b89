"""The replica server: holds peers' replicas and serves their pushes, offers and pulls, one thread
per connection.

Who may do what (everything else is refused and the connection dropped):
- every connection proves the job's replica token (handshake.py) within a deadline from accept,
  names a node of the ring from an address that name resolves to, and is of the same job; at most
  `Limits.max_pending` connections wait to do so, the oldest dropped (admission.py);
- push: only a node this one holds replicas for (Ring.held_by), only its own replica, for this
  job, at most the store's cap;
- offer and pull: only the node whose replica it is.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from diag.agent.replica.admission import Limits, Pending, next_deadline, refusal, to_drop
from diag.agent.replica.handshake import holder_side
from diag.agent.replica.parts import PartError, send_part
from diag.agent.replica.peers import Address, Peers
from diag.agent.replica.store import ReplicaStore, StoreBusy
from diag.agent.replica.wire import (
    Hello,
    Kind,
    OfferReply,
    Op,
    Result,
    manifest_body,
    offer_body,
    parse_manifest,
    recv,
    result_body,
    send,
)
from diag.formats.snapshot import ShmSpaceError
from diag.formats.untrusted import UntrustedInput

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 30.0  # a peer silent this long in the middle of a frame or a part is dropped


def _resolve(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # a restarted agent binds its port again at once
    daemon_threads = True
    request_queue_size = 128


@dataclass
class _Waiting:
    sock: socket.socket
    accepted_at: float
    dropped: str = ""  # why it was dropped, once it was


class Gate:
    """The connections that have not proven the token yet, dropped at their deadline or to make
    room (admission.to_drop), and the authenticated ones, counted per node."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._waiting: dict[int, _Waiting] = {}
        self._served: dict[str, int] = {}
        self._keys = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="replica-gate", daemon=True)
        self._reaper.start()

    def arrive(self, sock: socket.socket) -> int:
        with self._cond:
            key = next(self._keys)
            self._waiting[key] = _Waiting(sock, self.clock())
            self._drop_due()
            self._cond.notify()
            return key

    def rewrap(self, key: int, sock: socket.socket) -> None:
        """The connection's socket is now `sock` (TLS took the accepted one over)."""
        with self._cond:
            w = self._waiting.get(key)
            if w is not None:
                w.sock = sock
                if w.dropped:
                    _shut(sock)

    def dropped(self, key: int) -> str:
        with self._cond:
            w = self._waiting.get(key)
            return w.dropped if w is not None else ""

    def authenticated(self, key: int, node: str) -> str | None:
        """The connection proved the token as `node`: why it is not served, or None (then it
        counts against `node` until `leave`)."""
        with self._cond:
            w = self._waiting.pop(key, None)
            if w is None or w.dropped:
                return "dropped before it authenticated"
            why = refusal(node, self._served, self.limits)
            if why is None:
                self._served[node] = self._served.get(node, 0) + 1
            return why

    def leave(self, key: int, node: str | None) -> None:
        with self._cond:
            self._waiting.pop(key, None)
            if node is not None:
                n = self._served.get(node, 0) - 1
                if n > 0:
                    self._served[node] = n
                else:
                    self._served.pop(node, None)

    def waiting(self) -> int:
        with self._cond:
            return sum(1 for w in self._waiting.values() if not w.dropped)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._reaper.join(5)

    def _drop_due(self) -> None:
        """With the lock held."""
        pending = [Pending(k, w.accepted_at) for k, w in self._waiting.items() if not w.dropped]
        now = self.clock()
        for key in to_drop(pending, now, self.limits):
            w = self._waiting[key]
            late = now - w.accepted_at >= self.limits.auth_deadline
            w.dropped = (
                f"not authenticated within {self.limits.auth_deadline:g} s of accept" if late
                else f"dropped for a newer connection ({self.limits.max_pending} may wait)"
            )  # fmt: skip
            _shut(w.sock)

    def _reap(self) -> None:
        with self._cond:
            while not self._closed:
                self._drop_due()
                pending = [Pending(k, w.accepted_at) for k, w in self._waiting.items()
                           if not w.dropped]  # fmt: skip
                due = next_deadline(pending, self.limits)
                self._cond.wait(None if due is None else max(0.01, due - self.clock()))


def _shut(sock: socket.socket) -> None:
    # the plain socket's shutdown, also under TLS: the thread reading it sees the end
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class ReplicaServer:
    """Serves pushes, offers and pulls on a listening socket, one thread per connection."""

    def __init__(
        self,
        store: ReplicaStore,
        peers: Peers,
        listen: Address,
        *,
        on_event: Callable[[str, str], None] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.store = store
        self.peers = peers
        self.on_event = on_event or (lambda kind, detail: None)
        self.gate = Gate(limits or Limits())
        # Told to every peer that asks for an offer: one whose agent started while its own ranks
        # ran knows this node was lost and came back (job/silence.py).
        self.started = time.time()
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
        self.gate.close()

    def _serve(self, sock: socket.socket, peer: Address) -> None:
        key = self.gate.arrive(sock)
        node: str | None = None
        source = f"replica peer {peer[0]}:{peer[1]}"
        try:
            sock.settimeout(IDLE_TIMEOUT_S)
            if self.peers.tls is not None:
                sock = self.peers.tls.server.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
                self.gate.rewrap(key, sock)
                sock.do_handshake()
            hello = holder_side(sock, self.peers, source, lambda h: self._admit(h, peer[0], source))
            why = self.gate.authenticated(key, hello.node)
            if why is not None:
                raise UntrustedInput(source, f"not served: {why}")
            node = hello.node
            self._serve_op(sock, hello, source)
        except (UntrustedInput, OSError, ssl.SSLError, StoreBusy, ShmSpaceError, ValueError) as e:
            dropped = self.gate.dropped(key)
            if dropped:  # a slow or idle stranger: nothing to answer, little to log
                log.info("%s: %s", source, dropped)
                self.on_event("dropped", dropped)
                return
            if isinstance(e, UntrustedInput):
                log.warning("refused: %s", e)
                self.on_event("refused", str(e))
            else:
                log.warning("%s: %s", source, e)
                self.on_event("failed", str(e))
            with contextlib.suppress(OSError, ValueError):
                send(sock, Kind.RESULT, result_body(Result(False, str(e))))
        finally:
            self.gate.leave(key, node)
            if isinstance(sock, ssl.SSLSocket):  # socketserver closes the one it accepted
                with contextlib.suppress(OSError):
                    sock.close()

    def _serve_op(self, sock: socket.socket, hello: Hello, source: str) -> None:
        if hello.op == Op.PUSH:
            self._push(sock, hello, source)
        elif hello.op == Op.OFFER:
            held = self.store.held(hello.node)
            offer = held.offer() if held else OfferReply(None)
            send(sock, Kind.OFFER, offer_body(replace(offer, agent_started=self.started)))
        else:
            self._pull(sock, hello, source)

    def _admit(self, hello: Hello, ip: str, source: str) -> None:
        p = self.peers
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
