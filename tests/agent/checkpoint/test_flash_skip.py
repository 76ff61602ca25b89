"""A flash save that one rank must skip (its slots all wait for a persist) is skipped by every
rank: otherwise the ranks hold different steps in memory and a restart finds no common one.

Real 2-rank DeepSpeed job, real control channel and persist workers; the persists of rank 1 are
held back (its persist lock taken) so that its two slots stay pinned."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from flash_launch import Workspace

from diag.agent.checkpoint.manager import CheckpointManager, CheckpointSettings
from diag.agent.checkpoint.service import ControlServer
from diag.agent.checkpoint.sessions import RankKey
from diag.formats.rundir import control_socket_path


@pytest.fixture
def ws():
    root = Path(tempfile.mkdtemp(prefix="diag-test-skip-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-skip-run-", dir="/dev/shm"))
    try:
        yield Workspace(root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_skipped_on_one_rank_is_skipped_on_all(ws: Workspace) -> None:
    manager = CheckpointManager(ws.run_dir, None, CheckpointSettings(workers=8))
    server = ControlServer(control_socket_path(ws.run_dir, None), manager).start()
    held = manager.persister._rank_locks[RankKey("skip-z2", 1)]
    held.acquire()
    try:
        rc = ws.launch(
            "skip", "--zero", "2", "--job-prefix", "skip", "--persist-every", "1",
            "--wait-commands", "0.3", "--stats",
        )  # fmt: skip
        assert rc == 0, ws.log("skip")
    finally:
        held.release()
        server.stop()
        manager.close(timeout=30)
    stats = [json.loads((ws.root / "skip" / "z2" / f"stats-{r}.json").read_text()) for r in (0, 1)]
    assert stats[1]["skipped"] >= 1, stats  # rank 1's slots were all pinned
    assert stats[0]["skipped"] == stats[1]["skipped"], stats
    assert stats[0]["memory_step"] == stats[1]["memory_step"], stats
