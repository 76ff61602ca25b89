"""The writing mark: held by count while the agent writes a job's newest step to storage after
its ranks stopped (their own parts, then a lost peer's replica), so that ranks restarting at
another size wait for that step; gone once the last holder lets go, and a killed agent's is
removed at the next start."""

from __future__ import annotations

from replica_helpers import JOB, OWNERS, fill

from diag.agent.checkpoint.manager import CheckpointManager, CheckpointSettings
from diag.agent.checkpoint.writingmark import WritingMarks
from diag.formats.snapshot import read_latest_step, writing_marker_path


def test_the_mark_stays_while_anyone_holds_it(tmp_path):
    marks, mark = WritingMarks(tmp_path), writing_marker_path(tmp_path, "j")
    marks.take("j")
    marks.take("j")  # a handover takes it before the persist lets go
    assert mark.is_file() and mark.stat().st_mode & 0o777 == 0o600
    marks.release("j")
    assert mark.exists() and marks.held("j")
    marks.release("j")
    assert not mark.exists() and not marks.held("j")
    marks.release("j")  # one release too many changes nothing
    assert not mark.exists()


def test_a_planted_link_is_not_followed(tmp_path):
    target = tmp_path / "target"
    writing_marker_path(tmp_path, "j").symlink_to(target)
    marks = WritingMarks(tmp_path)
    marks.take("j")  # the link stays a link, nothing is created through it
    assert not target.exists()
    marks.release("j")


def test_a_killed_agent_s_mark_is_removed_at_the_next_start(tmp_path):
    writing_marker_path(tmp_path, JOB).touch()
    CheckpointManager(tmp_path, JOB, CheckpointSettings(), owners=OWNERS).close(5)
    assert not writing_marker_path(tmp_path, JOB).exists()


def test_the_persist_after_a_stop_holds_the_mark_through_its_hooks(tmp_path):
    run_dir, save = tmp_path / "run", tmp_path / "save"
    run_dir.mkdir()
    fill(run_dir, save, {0: [3], 1: [3]}, world=2)
    manager = CheckpointManager(run_dir, JOB, CheckpointSettings(), owners=OWNERS)
    seen = []
    manager.stopped_hooks.append(
        lambda jobs: seen.append(writing_marker_path(run_dir, JOB).exists())
    )
    try:
        manager.persist_all_jobs({JOB})
    finally:
        manager.close(5)
    assert read_latest_step(save) == 3
    assert seen == [True], "the hook ran without the mark"
    assert not writing_marker_path(run_dir, JOB).exists()
