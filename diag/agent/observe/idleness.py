"""Whether a rank's process did anything between two looks: the idle rule's evidence (overdue.py).

Idle is stricter than "its own CPU is low". A rank waiting on its DataLoader's queue uses no CPU
while the loader's worker processes decode; a rank reading a shard over the network or writing
a checkpoint to a remote store sleeps in a socket call. Neither is stuck. So a process counts as
active when, since the last look, it used IDLE_SHARE of a core or more, or its children did, or
more than IDLE_IO_RATE bytes went through its read and write calls (files, pipes and sockets
alike: /proc/PID/io's rchar and wchar). What cannot be read counts as active: the rule then
keeps the usual limit rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

# Below this share of one core a process is idle: a rank asleep in Python, or blocked on a lock,
# a queue or a socket, still spends a little on its other threads (heartbeats, gloo's loops).
IDLE_SHARE = 0.05
# Bytes per second through its read and write calls: the control channel's few messages are far
# below it, a batch from the loader or a download far above.
IDLE_IO_RATE = 64 * 1024
# Children looked at, at most: a rank with more (it forks freely) is taken as active rather than
# have the agent read thousands of /proc entries at every look.
MAX_CHILDREN = 256


@dataclass(frozen=True)
class _Look:
    at: float
    io: int | None  # rchar + wchar; None: unreadable
    children: dict[tuple[int, float], float] | None  # (pid, start) -> CPU seconds; None: not taken


class Idleness:
    def __init__(self) -> None:
        self._looks: dict[int, _Look] = {}

    def forget(self, pid: int) -> None:
        self._looks.pop(pid, None)

    def active(self, proc: psutil.Process, now: float, share: float) -> bool:
        """Whether `proc` (whose own CPU share since the last look is `share`) or its children
        worked since the last look. True at the first look and when anything is unreadable."""
        prev = self._looks.get(proc.pid)
        io = _io_bytes(proc)
        busy = share >= IDLE_SHARE
        # The children are listed (a walk of /proc) only while the process itself looks idle.
        children = None if busy else _children_cpu(proc)
        self._looks[proc.pid] = _Look(now, io, children)
        if busy or prev is None or now <= prev.at:
            return True
        seconds = now - prev.at
        if io is None or prev.io is None or io - prev.io > IDLE_IO_RATE * seconds:
            return True
        if children is None or prev.children is None:
            return True
        # A child not seen at the last look counts with all its CPU: it started meanwhile.
        used = sum(cpu - prev.children.get(key, 0.0) for key, cpu in children.items())
        return used >= IDLE_SHARE * seconds


def _io_bytes(proc: psutil.Process) -> int | None:
    try:
        io = proc.io_counters()
    except (psutil.Error, OSError, AttributeError, ValueError):
        return None
    chars = getattr(io, "read_chars", None), getattr(io, "write_chars", None)
    return None if None in chars else int(chars[0]) + int(chars[1])  # type: ignore[arg-type]


def _children_cpu(proc: psutil.Process) -> dict[tuple[int, float], float] | None:
    out: dict[tuple[int, float], float] = {}
    try:
        children = proc.children(recursive=True)
    except (psutil.Error, OSError, ValueError):
        return None
    if len(children) > MAX_CHILDREN:
        return None
    for child in children:
        try:
            t = child.cpu_times()
            out[(child.pid, child.create_time())] = t.user + t.system
        except psutil.NoSuchProcess:
            continue  # gone since the listing: whatever it did is no longer anyone's work
        except (psutil.Error, OSError, ValueError):
            return None
    return out
