"""AWS's and GCE's instance metadata endpoints, answering as documented, on 127.0.0.1.

AWS: `PUT /latest/api/token` (IMDSv2) gives a session token; `GET
/latest/meta-data/spot/instance-action` answers 404 until an interruption is scheduled, then 200
with `{"action": ..., "time": ...}`. GCE: `GET /computeMetadata/v1/instance/preempted` answers
FALSE, then TRUE, and 403 without `Metadata-Flavor: Google`.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACTION = b'{"action": "terminate", "time": "2026-11-24T08:22:00Z"}'
AWS_PATH = "/latest/meta-data/spot/instance-action"
GCE_PATH = "/computeMetadata/v1/instance/preempted"


def aws_action(seconds_ahead: float, action: str = "terminate") -> bytes:
    """The instance-action body AWS gives, for an interruption `seconds_ahead` from now."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_ahead))
    return f'{{"action": "{action}", "time": "{at}"}}'.encode()


class Metadata:
    def __init__(self, *, imdsv2: bool = True) -> None:
        self.scheduled = False
        self.action = ACTION
        self.imdsv2 = imdsv2
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                outer.requests.append(
                    ("PUT", self.path, {k.lower(): v for k, v in self.headers.items()})
                )
                if self.path == "/latest/api/token" and outer.imdsv2:
                    ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                    if not ttl:
                        return self._answer(400, b"")
                    return self._answer(200, b"TOKEN-1")
                self._answer(404, b"")

            def do_GET(self) -> None:
                outer.requests.append(
                    ("GET", self.path, {k.lower(): v for k, v in self.headers.items()})
                )
                if self.path == AWS_PATH:
                    if outer.imdsv2 and self.headers.get("X-aws-ec2-metadata-token") != "TOKEN-1":
                        return self._answer(401, b"")
                    if outer.scheduled:
                        return self._answer(200, outer.action)
                    return self._answer(404, b"Not Found")
                if self.path == GCE_PATH:
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._answer(403, b"")
                    return self._answer(200, b"TRUE" if outer.scheduled else b"FALSE")
                self._answer(404, b"")

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def aws_url(self) -> str:
        return self.base + AWS_PATH

    @property
    def gce_url(self) -> str:
        return self.base + GCE_PATH

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
