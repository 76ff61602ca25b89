"""Key names in the rendezvous store, in one place (all JSON values except the counters)."""

from __future__ import annotations

REPORT = "report"  # the final PrecheckReport, written by the coordinator
FAILURE = "failure"  # the coordinator crashed: {"error": ...}
ACKS = "acks"  # counter: nodes that have read the report


def join(node: int) -> str:
    return f"join/{node}"


def beat(node: int) -> str:
    return f"beat/{node}"  # counter bumped by the node's heartbeat thread


def plan(round_: int) -> str:
    """Round 0: {"nodes": [...]}, the nodes that made the rendezvous; later rounds
    {"pairs": [[a, b], ...]} or {"done": true}."""
    return f"plan/{round_}"


def local(node: int) -> str:
    return f"local/{node}"


def pair(round_: int, node: int) -> str:
    return f"pair/{round_}/{node}"
