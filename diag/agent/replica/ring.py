"""Who holds whose replica, what to send, and where a node that comes back empty restores from.

Pure: the job's node list, the replication factor and the facts a node gathered (its own slots,
its holders' offers, the step storage names) in; placements and choices out.

- The ring: the job's nodes in their given order (the order the job numbers them in, the same on
  every node). Node i's newest complete snapshot is held by the `factor` nodes after it,
  i+1 .. i+factor (mod n). A factor of 0 turns replication off; a factor past n-1 is n-1 (a node
  never holds its own replica: it would go with the node).
- What a node sends: the newest step every one of its ranks holds complete, taken by one launch of
  the trainer (parts of two launches are never one step).
- Where an empty node restores from: its holders' newest complete replica covering every one of
  its ranks, unless storage names a newer step (a replica is never preferred to a newer complete
  step elsewhere). What the job then resumes from is still the flash checkpointer's choice
  (`trainer.flash.resume.plan_resume`: the newest step in memory on every rank, or storage when it
  is newer), so the pulled replica counts exactly as the node's memory did before it was lost.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class RingError(ValueError):
    """The node list or the factor cannot make a ring."""


@dataclass(frozen=True)
class Ring:
    nodes: tuple[str, ...]
    factor: int

    @classmethod
    def of(cls, nodes: Sequence[str], factor: int) -> Ring:
        if factor < 0:
            raise RingError(f"the replication factor must be 0 or more, not {factor}")
        if any(not n for n in nodes):
            raise RingError("a node of the ring has an empty name")
        seen = set()
        for n in nodes:
            if n in seen:
                raise RingError(f"node {n!r} is listed twice")
            seen.add(n)
        return cls(tuple(nodes), min(factor, max(len(nodes) - 1, 0)))

    def _index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise RingError(f"node {node!r} is not one of the job's nodes") from None

    def holders(self, node: str) -> tuple[str, ...]:
        """The nodes that hold `node`'s replica, the first one first."""
        i, n = self._index(node), len(self.nodes)
        return tuple(self.nodes[(i + k) % n] for k in range(1, self.factor + 1))

    def held_by(self, node: str) -> tuple[str, ...]:
        """The nodes whose replicas `node` holds (one replica each)."""
        i, n = self._index(node), len(self.nodes)
        return tuple(self.nodes[(i - k) % n] for k in range(1, self.factor + 1))


@dataclass(frozen=True)
class Held:
    """A complete snapshot one rank of this node holds."""

    rank: int
    step: int
    run: str  # the trainer launch that took it


def step_to_send(ranks: Sequence[int], held: Sequence[Held]) -> tuple[int, str] | None:
    """The newest step complete on every one of `ranks` from a single launch, with that launch,
    or None when no step is."""
    if not ranks:
        return None
    per_rank: dict[int, set[tuple[int, str]]] = {r: set() for r in ranks}
    for h in held:
        if h.rank in per_rank:
            per_rank[h.rank].add((h.step, h.run))
    common = set.intersection(*per_rank.values())
    if not common:
        return None
    return max(common, key=lambda s: s[0])


@dataclass(frozen=True)
class Offer:
    """What a holder says it holds for a node: one complete replica."""

    holder: str
    step: int
    run: str
    world_size: int
    ranks: tuple[int, ...]


class Source(enum.Enum):
    LOCAL = "local"  # the node's own memory still holds snapshots: a process restart
    PEER = "peer"
    STORAGE = "storage"
    NONE = "none"


@dataclass(frozen=True)
class RestoreChoice:
    source: Source
    step: int | None
    holder: str | None
    reason: str


def choose_restore(
    *,
    local_steps: Sequence[int],
    offers: Sequence[Offer],
    storage_step: int | None,
    ranks: Sequence[int] = (),
    holders: Sequence[str] = (),
) -> RestoreChoice:
    """Where a node whose ranks are about to start takes their snapshots from.

    `local_steps`: complete steps the node's own memory holds (any rank); `offers`: its holders'
    replicas; `ranks`: the node's ranks when known (an offer must cover them all); `holders`: the
    ring's holders of the node, first first (ties between offers of one step go to the first)."""
    if local_steps:
        newest = max(local_steps)
        return RestoreChoice(Source.LOCAL, newest, None, f"memory holds step {newest}")
    want = set(ranks)
    order = {h: i for i, h in enumerate(holders)}
    usable = [o for o in offers if not want or want <= set(o.ranks)]
    if usable:
        best = max(usable, key=lambda o: (o.step, -order.get(o.holder, len(order))))
        if storage_step is not None and storage_step > best.step:
            return RestoreChoice(
                Source.STORAGE,
                storage_step,
                None,
                f"storage names step {storage_step}, newer than step {best.step} on {best.holder}",
            )
        return RestoreChoice(
            Source.PEER, best.step, best.holder, f"{best.holder} holds step {best.step}"
        )
    why = "no holder offers a replica" if not offers else "no replica covers every rank"
    if storage_step is not None:
        return RestoreChoice(Source.STORAGE, storage_step, None, f"{why}; storage names it")
    return RestoreChoice(Source.NONE, None, None, f"{why} and storage names no step")


def accepts(current: Offer | None, incoming_step: int, incoming_run: str) -> bool:
    """Whether a holder replaces its replica of a node with an incoming one: whenever it is
    another snapshot. The node sends only what its memory holds, one push at a time, so what
    arrives is the node's memory now: an older step (the ranks resumed from it, abandoning their
    newer ones) included. The same step of the same launch is already held."""
    return current is None or (incoming_step, incoming_run) != (current.step, current.run)
