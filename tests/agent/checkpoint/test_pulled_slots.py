"""A slot installed from a peer's replica, persisted by the checkpoint manager: only to --save-dir
or to a save directory this node's ranks name themselves, never to one only its description
names (agent.checkpoint.pulled); once a rank rewrites the slot, it is the rank's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from snapshot_helpers import new_slot, write_raw_snapshot

from diag.agent.checkpoint.manager import CheckpointManager, CheckpointSettings
from diag.agent.checkpoint.pulled import refusal
from diag.agent.checkpoint.sessions import RankKey
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import slot_path
from diag.formats.untrusted import Owners

JOB = "pj"


def slot(run_dir: Path, step: int, save_dir: Path, rank: int = 0) -> Path:
    path = slot_path(run_dir, JOB, rank, 0)
    s = SlotFile.open(path, writable=True) if path.exists() else new_slot(run_dir, JOB, rank, 0)
    write_raw_snapshot(s, step, {f"global_step{step}/r.bin": b"x" * 100}, job=JOB, rank=rank,
                       world=1, save_dir=save_dir, node="a", run="r1")  # fmt: skip
    s.close()
    return path


@pytest.fixture
def manager(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def make(save_dir: Path | None = None) -> CheckpointManager:
        m = CheckpointManager(run_dir, JOB, CheckpointSettings(save_dir=save_dir),
                              owners=Owners.this_process())  # fmt: skip
        made.append(m)
        return m

    made: list[CheckpointManager] = []
    yield make, run_dir
    for m in made:
        m.close(5)


def test_a_pulled_slot_goes_nowhere_its_description_alone_names(tmp_path, manager):
    make, run_dir = manager
    named = tmp_path / "home" / ".ssh"
    named.mkdir(parents=True)
    m = make()
    m.pulled.add([slot(run_dir, 7, named)], 7, "r1")
    results = m.persist_newest(JOB)
    assert [r.ok for r in results] == [False]
    assert "pulled from a peer's replica" in results[0].error
    assert list(named.iterdir()) == []


def test_a_pulled_slot_goes_where_a_rank_of_the_node_names_too(tmp_path, manager):
    make, run_dir = manager
    save = tmp_path / "save"
    save.mkdir()
    m = make()
    m.pulled.add([slot(run_dir, 7, save)], 7, "r1")
    m.sessions.register(RankKey(JOB, 0), 4242, save_dir=str(save))  # the rank registered
    assert [r.ok for r in m.persist_newest(JOB)] == [True]
    assert (save / "global_step7" / "r.bin").read_bytes() == b"x" * 100


def test_a_pulled_slot_goes_to_the_save_dir_option(tmp_path, manager):
    make, run_dir = manager
    named, own = tmp_path / "named", tmp_path / "own"
    named.mkdir()
    m = make(save_dir=own)
    m.pulled.add([slot(run_dir, 7, named)], 7, "r1")
    assert [r.ok for r in m.persist_newest(JOB)] == [True]
    assert (own / "global_step7" / "r.bin").is_file() and list(named.iterdir()) == []


def test_a_slot_the_rank_rewrote_is_its_own(tmp_path, manager):
    make, run_dir = manager
    named = tmp_path / "named"
    named.mkdir()
    m = make()
    path = slot(run_dir, 7, named)
    m.pulled.add([path], 7, "r1")
    slot(run_dir, 8, named)  # the rank's next snapshot, into the same file
    assert m.own_snapshots(JOB) and [r.ok for r in m.persist_newest(JOB)] == [True]
    assert (named / "global_step8" / "r.bin").is_file()


def test_the_rule():
    assert refusal("/ckpt", {"/ckpt", "/other"}) is None
    assert "no rank of this node names" in (refusal("/root/.ssh", {"/ckpt"}) or "")
    assert "they name: none" in (refusal("/ckpt", set()) or "")
