"""Slot descriptions already parsed, kept by the slot's identity and generation.

The agent reads every slot of its run directory at each scan, persist and stats call, and a
description is up to MAX_META_BYTES of JSON. A writer changes a description only by completing a
new snapshot, which gives the header a new generation (and completion time): so the same file
(device, inode, size) with the same header fields holds the same description, and it is parsed
once. A refusal is kept as well, so a bad slot costs one parse per change, not one per scan.
The cache is bounded in entries and in the bytes of the descriptions it holds, oldest use out
first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from diag.formats.refusals import MIB, UntrustedInput
from diag.formats.snapshot import SlotHeader, SnapshotMeta

MAX_ENTRIES = 512  # a node's ranks hold two slots each, a holder its peers' replicas beside
MAX_BYTES = 16 * MIB  # of description JSON; its parsed objects take a few times that


@dataclass(frozen=True)
class SlotIdentity:
    """What proves a slot's description unchanged since it was parsed."""

    device: int
    inode: int
    size: int
    gen: int
    step: int
    meta_offset: int
    meta_len: int
    completed_at: float
    writer_pid: int
    writer_start: float

    @classmethod
    def of(cls, device: int, inode: int, size: int, h: SlotHeader) -> SlotIdentity:
        return cls(
            device, inode, size, h.gen, h.step, h.meta_offset, h.meta_len, h.completed_at,
            h.writer_pid, h.writer_start,
        )  # fmt: skip


@dataclass(frozen=True)
class Parsed:
    """A description, or why it was refused."""

    meta: SnapshotMeta | None
    problem: str = ""


class DescriptionCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[SlotIdentity, Parsed] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the agent's persist workers read slots too
        self.parses = 0  # descriptions parsed, not found here

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def get(self, key: SlotIdentity) -> Parsed | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: SlotIdentity, parsed: Parsed) -> None:
        if key.meta_len > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = parsed
            self._bytes += key.meta_len
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                old, _ = self._entries.popitem(last=False)
                self._bytes -= old.meta_len

    def parse(
        self,
        key: SlotIdentity,
        source: str,
        parse: Callable[[], SnapshotMeta],
        unchanged: Callable[[], bool],
    ) -> SnapshotMeta:
        """The description of the slot `key` names: from the cache, else `parse()`d, and kept
        when `unchanged()` after it (a writer did not start over the slot meanwhile). Raises a
        refusal as an UntrustedInput naming `source`."""
        found = self.get(key)
        if found is None:
            self.parses += 1
            try:
                found = Parsed(parse())
            except UntrustedInput as e:
                found = Parsed(None, e.problem if e.path == source else str(e))
            if unchanged():
                self.put(key, found)
        if found.meta is None:
            raise UntrustedInput(source, found.problem)
        return found.meta


DESCRIPTIONS = DescriptionCache()  # every slot read in this process
