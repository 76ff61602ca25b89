"""The node's own network interface: which one reaches the rendezvous host, and its link state.

Read from the kernel (a routing decision via a UDP socket, psutil for addresses, sysfs for
state), so it works even when no packet can get through: a node whose link has no carrier can
still say so about itself.
"""

from __future__ import annotations

import socket
from pathlib import Path

import psutil

from diag.agent.node.linkstate import NicState

SYSFS_NET = Path("/sys/class/net")
_NO_CARRIER_STATES = ("down", "lowerlayerdown", "notpresent")


def source_addr_towards(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (no packet is sent)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def iface_of(addr: str) -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return None


def addr_of(iface: str) -> str | None:
    for a in psutil.net_if_addrs().get(iface, ()):
        if a.family in (socket.AF_INET, socket.AF_INET6):
            return a.address.split("%")[0]
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # e.g. `carrier` of an interface that is administratively down: EINVAL
        return None


def link_state(iface: str, addr: str | None, sysfs: Path = SYSFS_NET) -> NicState:
    base = sysfs / iface
    if not base.exists():
        return NicState(iface=iface, addr=addr, error=f"no interface {iface}")
    operstate = _read(base / "operstate")
    carrier_text = _read(base / "carrier")
    if carrier_text is not None:
        carrier: bool | None = carrier_text == "1"
    elif operstate in _NO_CARRIER_STATES:
        carrier = False
    else:
        carrier = None
    speed_text = _read(base / "speed")
    speed = int(speed_text) if speed_text and speed_text.lstrip("-").isdigit() else None
    return NicState(
        iface=iface,
        addr=addr,
        operstate=operstate,
        carrier=carrier,
        speed_mbps=speed if speed and speed > 0 else None,
    )


def probe(master_addr: str, master_port: int, iface: str | None = None) -> NicState:
    """State of `iface`, or of the interface routing to the rendezvous host."""
    if iface:
        return link_state(iface, addr_of(iface))
    try:
        addr = source_addr_towards(master_addr, master_port)
    except OSError as e:
        # No route at all: when every real interface is down, that is the node's own fault.
        down = [
            n
            for n in sorted(psutil.net_if_stats())
            if n != "lo" and link_state(n, None).carrier is False
        ]
        everything = [n for n in psutil.net_if_stats() if n != "lo"]
        if everything and len(down) == len(everything):
            return NicState(
                iface=",".join(down),
                operstate="down",
                carrier=False,
                error=f"no route to {master_addr}: {e}",
            )
        return NicState(error=f"no route to {master_addr}: {e}")
    name = iface_of(addr)
    if name is None:
        return NicState(addr=addr, error=f"no interface holds {addr}")
    return link_state(name, addr)
