"""How a journal names the process groups of a world formed again in place.

diag.trainer.resilient forms the world again after a fault, and torch names the new world's
groups afresh ("0", "1", ...): the journal tells them from their namesakes of the last world by
the world's generation, the same on every member rank. Pure.
"""

from __future__ import annotations

WORLD_MARK = "@"  # "<torch's name>@<generation>": a group of a world formed again in place


def group_in_world(name: str, generation: int) -> str:
    """The journal's name of torch's group `name` in world `generation` (diag.trainer.resilient
    forms the world again after a fault, and torch names its groups afresh: "0", "1", ...)."""
    return f"{name}{WORLD_MARK}{generation}" if generation else name


def world_of(group: str) -> int:
    """The generation of the world a journal's group belongs to (0: the first, or no wrapper)."""
    _, mark, tail = group.rpartition(WORLD_MARK)
    return int(tail) if mark and tail.isascii() and tail.isdigit() and len(tail) < 10 else 0


def era(attempt: int, generation: int) -> str:
    """The prefix of an incident id: the launcher's attempt, and the world's generation when the
    world formed again in place within it ("a3", "a3g2"). Faults in different worlds of one
    attempt are different incidents: a rank that died in world 0 was replaced, and does not
    explain a hang in world 1."""
    return f"a{attempt}g{generation}" if generation > 0 else f"a{attempt}"
