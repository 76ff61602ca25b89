"""A rank's own Python stacks, written on the agent's DUMP command where py-spy cannot attach
(no ptrace permission, no shared PID namespace). Same file format as the agent's dumps."""

from __future__ import annotations

import datetime as dt
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from diag.collector.meta import write_atomic
from diag.viewer.stacks import Frame, RankDump, ThreadStack, dump_file_name


def own_stacks(skip_current: bool = False) -> tuple[ThreadStack, ...]:
    names = {t.ident: t for t in threading.enumerate()}
    current = threading.get_ident()
    threads = []
    for tid, frame in sys._current_frames().items():
        if skip_current and tid == current:
            continue
        frames = tuple(
            Frame(func=fs.name, file=fs.filename, line=fs.lineno or 0)
            for fs in traceback.extract_stack(frame)
        )  # root first, as RankDump wants
        t = names.get(tid)
        threads.append(
            ThreadStack(
                tid=tid,
                os_tid=getattr(t, "native_id", 0) or 0,
                name=t.name if t is not None else "",
                frames=frames,
                active=tid == current,
            )
        )
    return tuple(sorted(threads, key=lambda s: s.tid))


def write_own_dump(
    directory: Path, *, rank: int, world_size: int, local_rank: int, node: str
) -> Path:
    started = time.monotonic()
    threads = own_stacks(skip_current=True)  # the control thread writing this is no evidence
    dump = RankDump(
        rank=rank,
        world_size=world_size,
        pid=os.getpid(),
        node=node,
        local_rank=local_rank,
        native=False,
        captured_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        capture_seconds=round(time.monotonic() - started, 4),
        threads=threads,
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / dump_file_name(rank, world_size)
    write_atomic(path, dump.to_json().encode())
    return path
