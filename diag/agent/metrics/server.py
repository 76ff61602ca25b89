"""The `/metrics` endpoint: a small HTTP server in the agent.

Our own handler rather than prometheus-client's, because the page may end with xpu_timer's hang
gauge, which must be written with integer values (see xputimer.py).

The port is reachable by anyone on the pod network, so a client must not be able to tie the
agent up: one thread waits for request heads on every connection at once (a selector), each
connection gets `header_timeout` seconds to send its head and at most `max_pending` wait at
once (the oldest is dropped), and only complete requests reach the `workers` threads that
render and reply, with a write timeout. Idle or half-sent connections cost a descriptor, never
a thread, and a scrape still answers while they sit there.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# The classic text format, which every Prometheus since 2.0 reads (and xpu_timer serves).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_HEAD = 8192  # bytes of request line and headers; a scrape sends a few hundred
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass
class _Pending:
    deadline: float
    head: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "text/plain"


def answer(request_line: bytes, render: Callable[[], bytes]) -> tuple[Reply, bool]:
    """The reply to a request line, and whether a body goes with it (not for HEAD)."""
    parts = request_line.split()
    if len(parts) not in (2, 3):
        return Reply(400, b"bad request\n"), True
    method, target = parts[0], parts[1]
    if method not in (b"GET", b"HEAD"):
        return Reply(405, b"only GET\n"), True
    path = target.split(b"?", 1)[0]
    if path == b"/metrics":
        try:
            return Reply(200, render(), CONTENT_TYPE), method == b"GET"
        except Exception:
            log.exception("rendering metrics failed")
            return Reply(500, b"rendering metrics failed\n"), True
    if path == b"/":
        return Reply(200, b"diag agent: metrics at /metrics\n"), method == b"GET"
    return Reply(404, b"not found\n"), True


def _encode(reply: Reply, with_body: bool) -> bytes:
    head = (
        f"HTTP/1.0 {reply.status} {_REASONS.get(reply.status, 'Error')}\r\n"
        f"Content-Type: {reply.content_type}\r\n"
        f"Content-Length: {len(reply.body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + reply.body if with_body else head


class MetricsServer:
    """Binds at construction (port 0 picks a free one, see `.port`), serves after `start()`."""

    def __init__(
        self,
        render: Callable[[], bytes],
        host: str,
        port: int,
        *,
        header_timeout: float = 10.0,
        write_timeout: float = 10.0,
        workers: int = 4,
        max_pending: int = 256,
        listener: socket.socket | None = None,
    ) -> None:
        """`listener`: a socket bound and listening already (before the agent gave up root,
        for a port below 1024); else one is bound to `host`:`port`."""
        self.render = render
        self.host = host
        self.header_timeout = header_timeout
        self.write_timeout = write_timeout
        self.workers = workers
        self.max_pending = max_pending
        self._listener = listener if listener is not None else bind_listener(host, port)
        try:
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self.port = self._listener.getsockname()[1]
        self._pending: dict[socket.socket, _Pending] = {}  # in order of arrival
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        # Replies queued or running; past it a complete request is dropped (the pool's queue
        # stays bounded).
        self._slots = threading.BoundedSemaphore(2 * workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="diag-metrics-reply")
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="diag-metrics", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for conn in list(self._pending):
            self._drop(conn)
        self._selector.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    # -- the waiting thread ------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            first = next(iter(self._pending.values()), None)
            wait = 0.5 if first is None else max(0.0, min(0.5, first.deadline - now))
            try:
                events = self._selector.select(timeout=wait)
            except OSError:
                if self._stop.is_set():
                    return
                raise
            try:
                for key, _ in events:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
            except Exception:  # a bug must not end the endpoint for the agent's lifetime
                log.exception("metrics server: handling a connection failed")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: drop nothing we hold, try again later
                log.warning("metrics server cannot accept: %s", e)
                return
            while len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending)))
            conn.setblocking(False)
            self._pending[conn] = _Pending(time.monotonic() + self.header_timeout)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is None:
            return
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        pending.head += data
        end = _head_end(pending.head)
        if end < 0 and len(pending.head) <= MAX_HEAD:
            return
        self._selector.unregister(conn)
        del self._pending[conn]
        if end < 0:
            line, status = b"", 431
        else:
            line, status = bytes(pending.head[: pending.head.find(b"\n")]).strip(), 0
        if not self._slots.acquire(blocking=False):
            log.debug("metrics server busy: a request dropped")
            conn.close()
            return
        self._pool.submit(self._reply, conn, line, status)

    def _expire(self, now: float) -> None:
        while self._pending:
            conn, pending = next(iter(self._pending.items()))
            # Deadlines grow in order of arrival: the first one not due ends the scan.
            if pending.deadline > now:
                return
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    # -- the reply threads -------------------------------------------------------------------

    def _reply(self, conn: socket.socket, line: bytes, status: int) -> None:
        try:
            if status:
                reply, body = Reply(status, b"request head too large\n"), True
            else:
                reply, body = answer(line, self.render)
            conn.settimeout(self.write_timeout)
            conn.sendall(_encode(reply, body))
            log.debug("metrics: %r -> %d", line[:200], reply.status)
        except OSError as e:
            log.debug("metrics reply failed: %s", e)
        finally:
            conn.close()
            self._slots.release()


def _head_end(buf: bytearray) -> int:
    """Where the request head ends (its blank line), or -1 while it is incomplete."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        i = buf.find(sep)
        if i >= 0:
            return i + len(sep)
    return -1


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock
