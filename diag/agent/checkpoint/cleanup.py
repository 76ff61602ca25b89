"""When the agent removes a job's snapshot slots from shared memory.

Slots of a job stay while any of its writers lives or is connected, while a persist of the job is
in flight, and, after a failure, for `linger` seconds (a restarted trainer loads them); after a
clean exit (every slot closed) they go at once.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import psutil

from diag.formats.slotfile import open_slot
from diag.formats.snapshot import SnapshotError, find_slots
from diag.formats.untrusted import Owners


@dataclass(frozen=True)
class SlotInfo:
    path: Path
    job: str
    writer_pid: int
    writer_start: float
    closed: bool  # its writer closed it (a clean exit)
    failed: bool  # its writer ended with an uncaught exception


def slots_by_job(
    run_dir: Path, job: str | None, owners: Owners | None = None
) -> dict[str, list[SlotInfo]]:
    """Trusted slot files by job (others are left alone: neither persisted nor removed)."""
    out: dict[str, list[SlotInfo]] = defaultdict(list)
    for p in find_slots(run_dir, job):
        slot = open_slot(p, owners)
        if slot is None:
            continue
        try:
            h = slot.header()
            out[h.job].append(SlotInfo(p, h.job, h.writer_pid, h.writer_start, h.closed, h.failed))
        except SnapshotError:
            continue
        finally:
            slot.close()
    return out


def removable(
    files: list[SlotInfo], *, busy: bool, dead_for: float, linger: float, final: bool
) -> bool:
    """For a job none of whose writers lives: whether its slots can go now."""
    if busy:
        return False
    return final or all(f.closed for f in files) or dead_for >= linger


def remove(files: list[SlotInfo]) -> list[Path]:
    removed = []
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.path)
            removed.append(f.path)
    return removed


def writer_alive(f: SlotInfo) -> bool:
    try:
        return abs(psutil.Process(f.writer_pid).create_time() - f.writer_start) <= 0.05
    except psutil.AccessDenied:
        return True
    except (psutil.NoSuchProcess, ValueError):
        return False
