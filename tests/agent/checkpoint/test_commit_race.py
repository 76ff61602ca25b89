"""Commits racing on one save directory, with real processes and threads: the persist workers of
one agent (threads of a process) and the agents of several nodes (processes) mark their ranks'
parts done and commit the same steps at once, old steps racing new ones. A reader process samples
`latest` and `dlrover_latest.txt` all along: each always names a whole step and never moves
backwards, no commit raises, no temporary file is left behind, and the newest step is committed.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import multiprocessing as mp
import os
import random
import threading
import time
import traceback
from pathlib import Path

import pytest

from diag.agent.checkpoint import storage
from diag.formats.snapshot import LATEST_FILE, TRACKER_FILE, read_latest_step

pytestmark = pytest.mark.timeout(240)

WORLD = 2
STEPS = 60
PROCESSES = 3
THREADS = 2


def _committer(save_dir: str, tasks: list[tuple[int, int]], errors, commits) -> None:
    """One agent: THREADS persist workers, each marking its parts done and committing."""
    chunks = [tasks[i::THREADS] for i in range(THREADS)]
    failures: list[str] = []
    done = [0]

    def work(chunk: list[tuple[int, int]]) -> None:
        for step, rank in chunk:
            try:
                storage.write_marker(Path(save_dir), step, rank, {"rank": rank, "step": step})
                if storage.try_commit(Path(save_dir), step, WORLD, keep=0):
                    done[0] += 1
            except Exception:
                failures.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in failures:
        errors.put(f)
    commits.put(done[0])


def _reader(save_dir: str, stop, out) -> None:
    """Samples both commit files until told to stop; sends what it saw."""
    seen: list[tuple[str, str]] = []
    latest, tracker = Path(save_dir, LATEST_FILE), Path(save_dir, TRACKER_FILE)
    while not stop.is_set():
        for path, kind in ((latest, "latest"), (tracker, "tracker")):
            with contextlib.suppress(FileNotFoundError):
                seen.append((kind, path.read_text()))
    out.put(seen)


def _steps_of(seen: list[tuple[str, str]], kind: str) -> list[int | None]:
    out: list[int | None] = []
    for k, text in seen:
        if k != kind:
            continue
        if kind == "latest":
            out.append(int(text[len("global_step") :]) if text.startswith("global_step") else None)
        else:
            out.append(int(text) if text.isdigit() else None)
    return out


def test_concurrent_commits_never_move_latest_backwards(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    ctx = mp.get_context("spawn")
    # Every process gets every part (several agents may persist and commit the same step), in an
    # order of its own: newer and older steps interleave across writers.
    rng = random.Random(11)
    parts = [(step, rank) for step in range(1, STEPS + 1) for rank in range(WORLD)]
    plans = []
    for _ in range(PROCESSES):
        # Roughly ascending, as persists arrive, with neighbours swapped: old commits race new.
        order = sorted(parts, key=lambda p: p[0] + rng.uniform(-4, 4))
        plans.append(order)
    errors, commits, seen_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop = ctx.Event()
    reader = ctx.Process(target=_reader, args=(str(save_dir), stop, seen_q), daemon=True)
    reader.start()
    procs = [
        ctx.Process(target=_committer, args=(str(save_dir), plan, errors, commits), daemon=True)
        for plan in plans
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
            assert p.exitcode == 0, f"a committer ended with {p.exitcode}"
        time.sleep(0.05)
        stop.set()
        seen = seen_q.get(timeout=60)
        reader.join(30)
    finally:
        stop.set()
        for p in [*procs, reader]:
            if p.is_alive():
                p.kill()
                p.join(10)

    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "commits raised:\n" + "\n".join(failures[:3])
    total = sum(commits.get(timeout=10) for _ in procs)
    assert total >= 1

    for kind in ("latest", "tracker"):
        steps = _steps_of(seen, kind)
        assert steps, f"the reader never saw {kind}"
        assert None not in steps, f"{kind} was seen torn or empty"
        backwards = [(a, b) for a, b in itertools.pairwise(steps) if b < a]
        assert not backwards, f"{kind} moved backwards: {backwards[:5]}"
    assert read_latest_step(save_dir) == STEPS
    assert (save_dir / TRACKER_FILE).read_text() == str(STEPS)
    leftovers = [p.name for p in save_dir.rglob("*") if ".tmp" in p.name]
    assert not leftovers, f"temporary files left: {leftovers[:5]}"


def test_without_file_locks_one_agents_threads_still_commit_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save directory on a filesystem that refuses file locks (ENOLCK, as some FUSE and
    object-store mounts answer): the persist threads of one agent still commit in step order."""

    def no_locks(fd: int, kind: int, *, wait: bool) -> bool:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(storage, "ofd_lock", no_locks)
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    steps = 200
    rng = random.Random(5)
    parts = [(step, rank) for step in range(1, steps + 1) for rank in range(WORLD)]
    order = sorted(parts, key=lambda p: p[0] + rng.uniform(-6, 6))
    threads_n = 6
    failures: list[str] = []
    seen: list[int] = []
    stop = threading.Event()

    def work(chunk: list[tuple[int, int]]) -> None:
        for step, rank in chunk:
            try:
                storage.write_marker(save_dir, step, rank, {"rank": rank, "step": step})
                storage.try_commit(save_dir, step, WORLD, keep=0)
            except Exception:
                failures.append(traceback.format_exc())

    def read() -> None:
        while not stop.is_set():
            step = read_latest_step(save_dir)
            if step is not None:
                seen.append(step)

    reader = threading.Thread(target=read)
    reader.start()
    workers = [threading.Thread(target=work, args=(order[i::threads_n],)) for i in range(threads_n)]
    with caplog.at_level("WARNING"):
        for t in workers:
            t.start()
        for t in workers:
            t.join(120)
    stop.set()
    reader.join(30)
    assert not failures, failures[0]
    assert "has no file locks" in caplog.text
    backwards = [(a, b) for a, b in itertools.pairwise(seen) if b < a]
    assert not backwards, f"latest moved backwards: {backwards[:5]}"
    assert read_latest_step(save_dir) == steps
