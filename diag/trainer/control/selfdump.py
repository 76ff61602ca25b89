"""A rank's own Python stacks, written on the agent's DUMP command where py-spy cannot attach
(no ptrace permission, no shared PID namespace). Same file format as the agent's dumps.

The directory comes from the agent, so it is confined beneath the rank's bases
(diag.trainer.control.dumpbase), walked from the base's descriptor without following a symlink, and the
file is created new (O_EXCL|O_NOFOLLOW, mode 0600) and renamed into place.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from diag.formats.stackdump import Frame, RankDump, ThreadStack, dump_file_name
from diag.formats.untrusted import walk_beneath, write_replace
from diag.trainer.control.dumpbase import DumpBases

DUMP_MODE = 0o600
DIR_MODE = 0o700


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
    directory: str, bases: DumpBases, *, rank: int, world_size: int, local_rank: int, node: str
) -> Path:
    """Writes this process's stacks into `directory` (named by the agent), confined beneath
    `bases`; raises UntrustedInput for a directory it must not write and OSError when writing
    fails."""
    base, parts = bases.confine(directory)
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
    name = dump_file_name(rank, world_size)
    # The base is the rank's own configuration (it may be a symlink to a volume); below it
    # nothing is followed.
    base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with walk_beneath(base_fd, parts, create=True, mode=DIR_MODE) as d:
            write_replace(d, name, dump.to_json().encode(), mode=DUMP_MODE)
    finally:
        os.close(base_fd)
    return base.joinpath(*parts, name)
