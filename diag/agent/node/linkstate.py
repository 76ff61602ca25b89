"""What the NIC probe finds of the interface that carries the node's traffic: plain data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NicState:
    """The interface that carries this node's traffic to the rendezvous host."""

    iface: str | None = None
    addr: str | None = None
    operstate: str | None = None  # /sys/class/net/IFACE/operstate
    carrier: bool | None = None
    speed_mbps: int | None = None
    error: str | None = None
