"""How much of its own output the agent keeps: incident directories in the timeline and the
lines of a job's taint history. A pure decision: entries (name, time, size) in, the names to
remove out. The adapter that lists and deletes is `prune.py`; the ledger trims its history
itself (`taint/ledger.py`).

Newest first, an entry goes when it is past the count, older than the age, or when the
entries newer than it already fill the byte budget. The newest entry and the protected ones
(the incident being written) always stay, and count toward the budgets.

The times come from a shared volume that others write, so an entry dated beyond `now` plus a
clock-skew allowance is suspect: it ranks below every real entry (it fills only the room they
leave, and goes first when there is none), and the verdict names it so the adapter can say so.
Fifty directories dated 2030 then cannot push out one real incident.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GIB = 1 << 30
# How far ahead of `now` an entry may be dated and still count as real: node and file-server
# clocks differ by seconds under NTP; minutes leave room for a node that drifted.
CLOCK_SKEW = 300.0


@dataclass(frozen=True)
class Retention:
    """What to keep; 0 switches a limit off."""

    count: int = 0  # entries kept, newest first
    max_age: float = 0.0  # seconds
    max_bytes: int = 0

    def __post_init__(self) -> None:
        if self.count < 0 or self.max_age < 0 or self.max_bytes < 0:
            raise ValueError(f"retention limits must be >= 0: {self}")


DEFAULT_INCIDENT_RETENTION = Retention(count=50, max_age=14 * 86400.0, max_bytes=2 * GIB)
DEFAULT_HISTORY_RETENTION = Retention(count=1000, max_age=30 * 86400.0, max_bytes=1 << 20)


@dataclass(frozen=True)
class Entry:
    name: str
    time: float  # seconds since the epoch: when it was written
    size: int  # bytes


@dataclass(frozen=True)
class Pruning:
    remove: tuple[str, ...]  # oldest first
    future: tuple[str, ...]  # dated beyond now + skew: ranked below every real entry


def decide(
    entries: Iterable[Entry],
    keep: Retention,
    now: float,
    protected: frozenset[str] = frozenset(),
    skew: float = CLOCK_SKEW,
) -> Pruning:
    """What `keep` lets go of `entries`, and which of them are dated in the future."""
    everything = list(entries)
    future = [e for e in everything if e.time > now + skew]
    real = [e for e in everything if e.time <= now + skew]
    # Keeping order: the real ones newest first, then the future ones nearest first (the
    # farthest in the future is the first to go).
    ranked = [
        *sorted(real, key=lambda e: (e.time, e.name), reverse=True),
        *sorted(future, key=lambda e: (e.time, e.name)),
    ]
    remove: list[str] = []
    kept = 0
    kept_bytes = 0
    full = False  # once an entry does not fit the byte budget, no lower-ranked one does either
    for i, e in enumerate(ranked):
        full = full or bool(keep.max_bytes and kept_bytes + e.size > keep.max_bytes)
        over = (
            full
            or (keep.count and kept >= keep.count)
            or (keep.max_age and now - e.time > keep.max_age)
        )
        if over and i > 0 and e.name not in protected:
            remove.append(e.name)
            continue
        kept += 1
        kept_bytes += e.size
    remove.reverse()
    return Pruning(tuple(remove), tuple(e.name for e in sorted(future, key=lambda e: e.name)))


def to_remove(
    entries: Iterable[Entry],
    keep: Retention,
    now: float,
    protected: frozenset[str] = frozenset(),
    skew: float = CLOCK_SKEW,
) -> list[str]:
    """The names of `entries` that `keep` lets go, the lowest ranked first."""
    return list(decide(entries, keep, now, protected, skew).remove)
