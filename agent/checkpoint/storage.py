"""The checkpoint directory on storage, as the agent maintains it (several nodes share it):

    <save_dir>/global_step{N}/...           DeepSpeed's own files, each written to a temporary
                                            name, fsynced, then renamed
    <save_dir>/zero_to_fp32.py ...          DeepSpeed's recovery scripts
    <save_dir>/.diag/global_step{N}/rank{R:05d}.done
                                            rank R's part of step N is on storage (JSON)
    <save_dir>/latest                       "global_step{N}", written last, and only once every
                                            rank's marker of step N exists
    <save_dir>/dlrover_latest.txt           "N": the tracker DLRover and ms-swift resume from

`should_commit` and `prune_plan` are the pure rules; the rest are thin file operations.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from diag.collector.snapshot import (
    LATEST_FILE,
    TRACKER_FILE,
    read_latest_step,
    step_tag,
    tag_step,
)

MARKER_DIR = ".diag"


def should_commit(step: int, world_size: int, done: set[int], latest: int | None) -> bool:
    """Every rank's part of `step` is on storage, and `latest` would move forward."""
    return world_size > 0 and done >= set(range(world_size)) and (latest is None or step > latest)


def prune_plan(steps: Iterable[int], committed: int | None, keep: int) -> list[int]:
    """Steps to delete so that only the `keep` newest committed ones remain. Steps newer than the
    committed one may still be in progress on other nodes: never touched. keep <= 0 keeps all."""
    if keep <= 0 or committed is None:
        return []
    done = sorted((s for s in set(steps) if s <= committed), reverse=True)
    return sorted(done[keep:])


def marker_path(save_dir: Path, step: int, rank: int) -> Path:
    return save_dir / MARKER_DIR / step_tag(step) / f"rank{rank:05d}.done"


def done_ranks(save_dir: Path, step: int) -> set[int]:
    d = save_dir / MARKER_DIR / step_tag(step)
    out = set()
    with contextlib.suppress(FileNotFoundError):
        for p in d.iterdir():
            if p.name.startswith("rank") and p.name.endswith(".done"):
                with contextlib.suppress(ValueError):
                    out.add(int(p.name[4:-5]))
    return out


def marked_steps(save_dir: Path) -> set[int]:
    """Steps with at least one marker: the ones we wrote."""
    out = set()
    with contextlib.suppress(FileNotFoundError):
        for p in (save_dir / MARKER_DIR).iterdir():
            step = tag_step(p.name)
            if step is not None:
                out.add(step)
    return out


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, fill: Callable[[int], object], mode: int = 0o644) -> None:
    """Writes a file through `fill(fd)` under a temporary name, fsyncs it, renames it into place.
    Readers see the old file or the complete new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        fill(fd)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    os.close(fd)
    os.replace(tmp, path)


def write_bytes_atomic(path: Path, data: bytes | memoryview, mode: int = 0o644) -> None:
    def fill(fd: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]

    write_atomic(path, fill, mode)


def write_marker(save_dir: Path, step: int, rank: int, doc: dict) -> None:
    path = marker_path(save_dir, step, rank)
    write_bytes_atomic(path, json.dumps(doc, indent=1).encode())
    fsync_dir(path.parent)


def try_commit(save_dir: Path, step: int, world_size: int, keep: int) -> bool:
    """Writes `latest` and the tracker file when every rank's part of `step` is on storage, then
    prunes old steps. Agents of several nodes may race here: both write the same content, and
    `latest` only ever moves forward."""
    if not should_commit(step, world_size, done_ranks(save_dir, step), read_latest_step(save_dir)):
        return False
    # Every rank's files and their directory entries were fsynced before its marker was written.
    write_bytes_atomic(save_dir / LATEST_FILE, step_tag(step).encode())
    write_bytes_atomic(save_dir / TRACKER_FILE, str(step).encode())
    fsync_dir(save_dir)
    for old in prune_plan(marked_steps(save_dir), step, keep):
        shutil.rmtree(save_dir / step_tag(old), ignore_errors=True)
        shutil.rmtree(save_dir / MARKER_DIR / step_tag(old), ignore_errors=True)
    return True


def committed_step(save_dir: Path) -> int | None:
    return read_latest_step(save_dir)
