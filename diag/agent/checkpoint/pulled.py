"""Slots the agent installed from a peer's replica, and where such a slot may be persisted.

A snapshot's description names its save directory. For a rank's own slot that is the trainer's
choice on this node (and savedir.py bounds it by ownership); for a slot pulled from a peer's
replica it is what another node sent: a holder must not choose where this node writes. So a
pulled slot goes to `--save-dir`, or to the save directory its description names only when a
rank of this node names that same directory too (when it registers over the control channel, or
in a snapshot of its own); otherwise it is not persisted, and stays in memory for the ranks to
load. Once a rank writes a newer snapshot into the file, the slot is the rank's own again.

`refusal` is the pure rule; `PulledSlots` remembers the files (device, inode, step, launch).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from diag.formats.slotfile import Snapshot


@dataclass(frozen=True)
class PulledSlot:
    dev: int
    ino: int
    step: int
    run: str


def refusal(save_dir: str, named: Collection[str]) -> str | None:
    """Why a pulled slot naming `save_dir` is not persisted there, given the save directories
    this node's own ranks name (None: it may be)."""
    if save_dir in named:
        return None
    own = ", ".join(sorted(named)) or "none"
    return (
        f"it was pulled from a peer's replica and names the save directory {save_dir}, which no "
        f"rank of this node names (they name: {own}); a peer does not choose where this node "
        "writes: not persisted (set --save-dir to persist pulled replicas)"
    )


class PulledSlots:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: set[PulledSlot] = set()

    def add(self, paths: Iterable[Path], step: int, run: str) -> None:
        found = set()
        for p in paths:
            try:
                st = os.stat(p, follow_symlinks=False)
            except OSError:
                continue
            found.add(PulledSlot(st.st_dev, st.st_ino, step, run))
        with self._lock:
            self._slots |= found

    def holds(self, snap: Snapshot) -> bool:
        """Whether `snap` is still what a pull installed (not a snapshot a rank wrote since)."""
        with self._lock:
            if not self._slots:
                return False
            slots = set(self._slots)
        try:
            st = os.stat(snap.path, follow_symlinks=False)
        except OSError:
            return False
        return PulledSlot(st.st_dev, st.st_ino, snap.meta.step, snap.meta.run) in slots
