"""The `/metrics` endpoint: a small threaded HTTP server in the agent.

Our own handler rather than prometheus-client's, because the page may end with xpu_timer's hang
gauge, which must be written with integer values (see xputimer.py).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

# The classic text format, which every Prometheus since 2.0 reads (and xpu_timer serves).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], render: Callable[[], bytes]) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.render = render
        super().__init__(addr, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body, ctype, status = self.server.render(), CONTENT_TYPE, 200
            except Exception:
                log.exception("rendering metrics failed")
                body, ctype, status = b"rendering metrics failed\n", "text/plain", 500
        elif path == "/":
            body, ctype, status = b"diag agent: metrics at /metrics\n", "text/plain", 200
        else:
            body, ctype, status = b"not found\n", "text/plain", 404
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class MetricsServer:
    """Binds at construction (port 0 picks a free one, see `.port`), serves after `start()`."""

    def __init__(self, render: Callable[[], bytes], host: str, port: int) -> None:
        self._server = _Server((host, port), render)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="diag-metrics",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
