"""The flash checkpointers this process has open, so that in-place recovery (trainer.resilient)
can close a failed attempt's checkpointers, keeping their snapshots for the next attempt to load."""

from __future__ import annotations

import weakref
from typing import Any

_open: weakref.WeakSet[Any] = weakref.WeakSet()


def opened(checkpointer: Any) -> None:
    _open.add(checkpointer)


def engines() -> list[Any]:
    """The engines of the open checkpointers, each once."""
    seen: dict[int, Any] = {}
    for c in list(_open):
        engine = getattr(c, "engine", None)
        if engine is not None:
            seen.setdefault(id(engine), engine)
    return list(seen.values())


def close_all() -> int:
    """Closes every open checkpointer of a failed attempt, its slots kept for the next one (not
    removed, marked as a failed exit's). Returns how many."""
    closing = list(_open)
    for c in closing:
        c.close(remove=False, for_restart=True)
        _open.discard(c)
    return len(closing)
