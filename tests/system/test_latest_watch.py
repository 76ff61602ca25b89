"""The kill suite's watch of `latest` (killchecks.LatestWatch), on steps committed by the agent's
own commit (storage.try_commit): it reports `latest` moving backwards when it does, and only
then, also when its thread and the suite's check after a kill read `latest` at the same time."""

from __future__ import annotations

import threading
from pathlib import Path

import killchecks
import pytest
from faults import write_json_atomic
from killchecks import WORLD, LatestWatch

from diag.agent.checkpoint import storage
from diag.formats.snapshot import step_tag


def commit(save_dir: Path, step: int) -> None:
    """Every rank's part of `step` (ZeRO-1 file names), its markers, then the agent's commit."""
    tag = step_tag(step)
    names = [f"{tag}/mp_rank_00_model_states.pt"]
    names += [f"{tag}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)]
    data = b"x" * 16
    with storage.opened(save_dir, create=True) as base:
        for name in names:
            storage.write_bytes_atomic(base, tuple(name.split("/")), data)
    for rank in range(WORLD):
        files = names if rank == 0 else names[1 + rank :]
        doc = {"rank": rank, "run": "run-1", "files": files, "bytes": len(data) * len(files)}
        storage.write_marker(save_dir, step, rank, doc)
    assert storage.try_commit(save_dir, step, WORLD, keep=0)


def test_two_checks_at_once_see_latest_move_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch's thread reads step 9, then loses the processor; meanwhile step 10 commits and
    the suite checks. `latest` went 9 -> 10: no problem, both steps seen in order."""
    commit(tmp_path, 9)
    watch = LatestWatch(tmp_path, zero=1)  # not started: the two threads below are its checkers
    read = killchecks.read_latest_step
    paused, resume = threading.Event(), threading.Event()
    slow = threading.Thread(target=watch.check, name="latest-watch")

    def read_then_pause(save_dir: Path) -> int | None:
        step = read(save_dir)
        if threading.current_thread() is slow and not paused.is_set():
            paused.set()
            assert resume.wait(10)
        return step

    monkeypatch.setattr(killchecks, "read_latest_step", read_then_pause)
    slow.start()
    assert paused.wait(10), "the watch's check never read latest"
    commit(tmp_path, 10)
    after_kill = threading.Thread(target=watch.check, name="after-kill")
    after_kill.start()
    after_kill.join(1.0)  # unordered, it reads step 10 and raises `highest` before `slow` goes on
    resume.set()
    slow.join(10)
    after_kill.join(10)
    assert not slow.is_alive() and not after_kill.is_alive()
    assert watch.take_problems() == []
    assert watch.seen == [9, 10]
    assert watch.highest == 10


def test_latest_written_backwards_is_reported(tmp_path: Path) -> None:
    commit(tmp_path, 9)
    commit(tmp_path, 10)
    watch = LatestWatch(tmp_path, zero=1)
    assert watch.check() == 10
    write_json_atomic(tmp_path / "latest", step_tag(9))  # not through the commit rules
    assert watch.check() == 9
    assert watch.take_problems() == ["latest moved backwards: 10 -> 9"]
    assert watch.problems == []  # taken: the next kill starts clean
