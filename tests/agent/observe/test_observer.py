"""The observer with real writer processes: leftovers of earlier runs are ignored, a live rank is
watched, deaths are seen (also of a rank that died before it was first seen), and ranks that
ended a while ago leave the view."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from diag.agent.detect.observation import Liveness
from diag.agent.observe import observer as observer_mod
from diag.agent.observe.observer import Observer
from diag.formats.journalmeta import JournalMeta, journal_path, write_meta
from diag.formats.journalwriter import JournalWriter
from diag.formats.records import RecordKind

pytestmark = pytest.mark.timeout(60)


def _writer(run_dir: str, rank: int, ready) -> None:
    path = journal_path(Path(run_dir), "obs", rank)
    w = JournalWriter(path, rank=rank, world_size=4, local_rank=rank)
    write_meta(
        path,
        JournalMeta(
            job="obs",
            rank=rank,
            world_size=4,
            local_rank=rank,
            local_world_size=4,
            pid=os.getpid(),
            pid_start_time=psutil.Process().create_time(),
            node="n",
        ),
    )
    w.mark("hello")
    ready.set()
    time.sleep(30)  # until the test kills it


def _start(ctx, run_dir: Path, rank: int):
    ready = ctx.Event()
    p = ctx.Process(target=_writer, args=(str(run_dir), rank, ready), daemon=True)
    p.start()
    assert ready.wait(30)
    return p


def _liveness(obs, rank: int) -> Liveness | None:
    r = obs.rank(rank)
    return r.liveness if r is not None else None


def test_leftovers_live_ranks_deaths_and_forgetting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(observer_mod, "ENDED_LINGER_S", 1.0)
    ctx = mp.get_context("spawn")
    old = _start(ctx, tmp_path, 0)  # a rank of an earlier run, killed before we start
    os.kill(old.pid, signal.SIGKILL)
    old.join(10)
    time.sleep(0.1)
    obs = Observer(tmp_path, "obs", agent_pids=frozenset())  # the ranks are our children
    live = _start(ctx, tmp_path, 1)
    try:
        first = obs.observe(time.monotonic())
        assert _liveness(first, 0) is None  # the leftover is not judged
        assert _liveness(first, 1) == Liveness.RUNNING
        assert [r.kind for r in obs.trackers[next(iter(obs.trackers))].reader.tail(1)] == [
            RecordKind.MARK
        ]
        # A rank that starts and dies between two looks: seen as dead, not as a silent live one.
        quick = _start(ctx, tmp_path, 2)
        os.kill(quick.pid, signal.SIGKILL)
        quick.join(10)
        second = obs.observe(time.monotonic())
        assert _liveness(second, 2) == Liveness.DIED
        os.kill(live.pid, signal.SIGKILL)
        live.join(10)
        obs.wait(2.0)  # the pidfd wakes us
        third = obs.observe(time.monotonic())
        assert _liveness(third, 1) == Liveness.DIED and third.rank(1).exited_at is not None
        time.sleep(1.2)
        later = obs.observe(time.monotonic())
        assert later.ranks == ()  # ended over a second ago (the linger here): out of view
    finally:
        if live.is_alive():
            live.kill()
            live.join(10)
        obs.close()


_NS_WRITER = """
import os, sys, time
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", DIAG_CONTROL="0")
import diag.trainer
diag.trainer.attach(run_dir=sys.argv[1], job="obs")
print(os.getpid(), flush=True)
time.sleep(60)
"""


def test_rank_in_another_pid_namespace_is_not_taken_for_dead(tmp_path: Path, caplog) -> None:
    """A trainer in a PID namespace of its own (a pod without shareProcessNamespace): its PID
    names nothing of ours, or another process (PID 1 exists in every namespace). That is a
    warning to fix the deployment, never a death."""
    import subprocess
    import sys

    obs = Observer(tmp_path, "obs", agent_pids=frozenset())  # the ranks are our children
    proc = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            _NS_WRITER,
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "1"  # PID 1 in its own namespace
        for _ in range(3):
            first = obs.observe(time.monotonic())
            assert _liveness(first, 0) == Liveness.RUNNING
            time.sleep(0.2)
        assert "is not visible to the agent" in caplog.text
    finally:
        proc.kill()
        proc.wait(10)
        obs.close()


def _failing_writer(run_dir: str, rank: int) -> None:
    from diag.formats.journal import JournalStatus
    from diag.formats.rundir import pid_namespace

    path = journal_path(Path(run_dir), "obs", rank)
    w = JournalWriter(path, rank=rank, world_size=2, local_rank=rank)
    meta = JournalMeta(
        job="obs", rank=rank, world_size=2, local_rank=rank, local_world_size=2,
        pid=os.getpid(), pid_start_time=psutil.Process().create_time(), node="n",
        pid_ns=pid_namespace(),
    )  # fmt: skip
    write_meta(path, meta)
    w.mark("hello")
    w.close(JournalStatus.FAILED if rank == 1 else JournalStatus.CLOSED)


def test_ranks_that_ended_before_the_first_look(tmp_path: Path) -> None:
    """Both gone before the agent first looks: the one that failed is judged, the one that
    finished cleanly is not."""
    obs = Observer(tmp_path, "obs", agent_pids=frozenset())  # the ranks are our children
    ctx = mp.get_context("spawn")
    for rank in (0, 1):
        p = ctx.Process(target=_failing_writer, args=(str(tmp_path), rank))
        p.start()
        p.join(30)
    try:
        first = obs.observe(time.monotonic())
        assert _liveness(first, 1) == Liveness.FAILED
        assert _liveness(first, 0) is None
    finally:
        obs.close()
