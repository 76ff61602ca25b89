"""Agent commands at step boundaries: every rank acts on the same step.

The control thread drops FLUSH and EXIT commands into a mailbox; at step boundaries the ranks
all-reduce (MAX) a five-number vector (flush, exit, exit code, no agent, minus the proposed period)
over a CPU (gloo) group, the way ms-swift's graceful exit does with one byte, so a command or a
stop request that reached one rank (or one node's agent) is honoured by all ranks at the same
step. The same collective agrees on when to meet next (diag.trainer.control.period): one tiny collective
every few steps, as often as a stop-latency bound in seconds and a cost budget allow.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pending:
    command_id: str
    kind: str  # "flush" or "exit"
    exit_code: int = 0


@dataclass(frozen=True)
class Agreement:
    flush: bool
    exit: bool
    exit_code: int
    # Agreed: steps until the ranks meet again (the smallest rank's proposal).
    every: int = 1
    # Agreed: some rank has no agent connected, so a save cannot go through flash memory alone.
    no_agent: bool = False


@dataclass
class CommandBox:
    _items: list[Pending] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, item: Pending) -> None:
        with self._lock:
            self._items.append(item)

    def take(self) -> list[Pending]:
        with self._lock:
            items, self._items = self._items, []
            return items

    def local_flags(self) -> Agreement:
        with self._lock:
            exits = [p for p in self._items if p.kind == "exit"]
            return Agreement(
                flush=any(p.kind == "flush" for p in self._items),
                exit=bool(exits),
                exit_code=max((p.exit_code for p in exits), default=0),
            )


MAX_EVERY = 1 << 30


def agree(local: Agreement, group: Any, world_size: int) -> Agreement:
    """The MAX over all ranks of every rank's flags and the MIN of their proposed periods."""
    if world_size <= 1:
        return local
    import torch
    import torch.distributed as dist

    every = max(1, min(local.every, MAX_EVERY))
    flags = torch.tensor(
        [int(local.flush), int(local.exit), max(0, min(local.exit_code, 255)),
         int(local.no_agent), -every],
        dtype=torch.int32,
    )  # fmt: skip
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    v = flags.tolist()
    return Agreement(bool(v[0]), bool(v[1]), int(v[2]), every=-int(v[4]), no_agent=bool(v[3]))


def command_group(dist: Any) -> Any:
    """A CPU group for the flags: the default group when it is gloo, else a new gloo group (so a
    NCCL job does not synchronize a CUDA stream for three bytes). Collective: all ranks call it."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
