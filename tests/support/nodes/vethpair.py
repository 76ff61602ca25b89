"""A veth pair for NIC tests: one end in this network namespace (so this process and the agents
it starts read its carrier in /sys/class/net), the peer in a namespace of its own, where taking
it down leaves our end without carrier. No address, no route: nothing else on the host sees it.
Removed (with its namespace) on exit."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Veth:
    host: str  # our end
    peer: str
    ns: str

    def peer_link(self, state: str) -> None:
        """`up` or `down`, and wait until our end's carrier says so."""
        subprocess.run(
            ["ip", "netns", "exec", self.ns, "ip", "link", "set", self.peer, state],
            check=True,
            timeout=30,
        )
        want = "1" if state == "up" else "0"
        deadline = time.monotonic() + 10
        while self.carrier() != want and time.monotonic() < deadline:
            time.sleep(0.05)

    def operstate(self) -> str:
        with open(f"/sys/class/net/{self.host}/operstate") as f:
            return f.read().strip()

    def carrier(self) -> str:
        with open(f"/sys/class/net/{self.host}/carrier") as f:
            return f.read().strip()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=30, capture_output=True)


@contextmanager
def veth_pair(prefix: str = "dv") -> Iterator[Veth]:
    """Our end up, the peer down: no carrier until `peer_link("up")`."""
    tag = f"{prefix}{os.getpid() % 100000}{time.monotonic_ns() % 1000}"[:13]
    v = Veth(f"{tag}a", f"{tag}b", f"diag-veth-{tag}")
    _ip("netns", "add", v.ns)
    try:
        _ip("link", "add", v.host, "type", "veth", "peer", "name", v.peer)
        try:
            _ip("link", "set", v.peer, "netns", v.ns)
            _ip("link", "set", v.host, "up")
            # The kernel settles our end's state asynchronously ("down" for a moment).
            deadline = time.monotonic() + 10
            while v.operstate() != "lowerlayerdown" and time.monotonic() < deadline:
                time.sleep(0.05)
            yield v
        finally:
            _ip("link", "del", v.host)
    finally:
        _ip("netns", "del", v.ns)
