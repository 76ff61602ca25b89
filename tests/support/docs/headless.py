"""One headless Chromium (Debian's `chromium`) driven over the DevTools protocol, on its
websocket: open a page, wait for it to load, run a script in it, see every request it makes.

Started with a fresh profile and everything that would reach out switched off (updates, sync,
QUIC, first-run pages); nothing here downloads a browser. `chromium()` skips the test where the
package is missing (scripts/bootstrap.sh installs it as root).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no chromium: add it with scripts/bootstrap.sh (Debian package `chromium`)")


class DevToolsError(RuntimeError):
    pass


class Browser:
    """A headless Chromium with one page, driven over the DevTools protocol. Use as a context
    manager: the browser, its children and its profile go at the end."""

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 60.0) -> None:
        import websocket  # websocket-client, a dependency of the kubernetes client

        self.timeout = timeout
        self.profile = Path(tempfile.mkdtemp(prefix="diag-chromium-"))
        self.proc = subprocess.Popen(
            [
                chromium(),
                *FLAGS,
                f"--user-data-dir={self.profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._events: deque[dict[str, Any]] = deque()
        self._next_id = 0
        try:
            port = self._port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                targets = json.load(r)
            page = next(t for t in targets if t.get("type") == "page")
            # Chromium refuses a websocket with an Origin header it was not told to allow.
            self.ws = websocket.create_connection(
                page["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True
            )
        except BaseException:
            self._stop()
            raise
        self.requests: list[str] = []  # every URL the page asked for since the last navigate

    def _port(self) -> int:
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise DevToolsError(f"chromium exited with {self.proc.returncode}: {err[-2000:]}")
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(active.read_text().splitlines()[0])
            time.sleep(0.05)
        raise DevToolsError(f"chromium wrote no {active.name} in {self.timeout:g} s")

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        self._stop()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    # -- the protocol ----------------------------------------------------------------------

    def _receive(self, deadline: float) -> dict[str, Any]:
        self.ws.settimeout(max(0.01, deadline - time.monotonic()))
        msg = json.loads(self.ws.recv())
        if msg.get("method") == "Network.requestWillBeSent":
            self.requests.append(msg["params"]["request"]["url"])
        return msg

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Runs a protocol command; its result. Events that arrive meanwhile are kept."""
        self._next_id += 1
        ident = self._next_id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._receive(deadline)
            if msg.get("id") == ident:
                if "error" in msg:
                    raise DevToolsError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self._events.append(msg)

    def wait_event(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            while self._events:
                msg = self._events.popleft()
                if msg["method"] == method:
                    return msg.get("params", {})
            if time.monotonic() > deadline:
                raise DevToolsError(f"no {method} in {self.timeout:g} s")
            msg = self._receive(deadline)
            if "method" in msg:
                self._events.append(msg)

    # -- what tests use ---------------------------------------------------------------------

    def start(self, before_each_page: str = "") -> None:
        """Turns on the page and network events; `before_each_page` runs in every page before
        its own scripts."""
        self.send("Page.enable")
        self.send("Network.enable")
        if before_each_page:
            self.send("Page.addScriptToEvaluateOnNewDocument", source=before_each_page)

    def open(self, url: str) -> None:
        """Loads `url` and waits for its load event."""
        self._events.clear()
        self.requests = []
        nav = self.send("Page.navigate", url=url)
        if nav.get("errorText"):
            raise DevToolsError(f"{url}: {nav['errorText']}")
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a script in the page (a promise is awaited), as JSON gives it."""
        got = self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in got:
            raise DevToolsError(json.dumps(got["exceptionDetails"])[:2000])
        return got["result"].get("value")
