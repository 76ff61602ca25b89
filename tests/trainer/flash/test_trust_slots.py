"""Flash-checkpoint slots are input from another process: a slot names the files the agent writes
and the pickles the trainer loads. A planted or malformed slot must never write outside the save
directory, set a mode, follow a symlink, crash a reader, or run code in the trainer."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from repo import SUPPORT
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.persist import persist_slot
from diag.formats.slotfile import SlotFile, read_snapshots
from diag.formats.snapshot import find_slots, slot_path
from diag.trainer.flash.capture import CapturedFile, unpickle_state
from diag.trainer.flash.restore import LoadFailure, Place, memory_index, stage
from diag.trainer.flash.unpickler import RefusedGlobal

NOBODY = 65534
MODEL = "global_step5/mp_rank_00_model_states.pt"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-trust-slots-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _valid(run_dir: Path, save: Path, job: str = "j", rank: int = 0, step: int = 5) -> SlotFile:
    slot = new_slot(run_dir, job, rank, 0)
    files = captured({f"global_step{step}/mp_rank_00_model_states.pt": model_states(step)})
    write_snapshot(slot, step, files, job=job, rank=rank, world=1, save_dir=save)
    return slot


def _replace_meta(slot: SlotFile, edit) -> None:  # type: ignore[no-untyped-def]
    """Rewrites the slot's description (the data stays): what a writer of the slot could plant."""
    h = slot.header()
    raw = json.loads(bytes(slot.mm[h.meta_offset : h.meta_offset + h.meta_len]))
    blob = edit(raw)
    blob = blob if isinstance(blob, bytes) else json.dumps(blob).encode()
    gen = slot.begin_write()
    slot.mm[h.meta_offset : h.meta_offset + len(blob)] = blob
    slot.finish_write(gen, h.step, h.meta_offset, len(blob), 0.0)


def _raw_entry(path: str, offset: int, length: int, mode: int = 0o644) -> dict:
    return {"path": path, "kind": "raw", "persist": True, "data": {"offset": offset,
            "length": length}, "mode": mode}  # fmt: skip


def _no_loose_modes(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        m = os.lstat(p).st_mode
        assert not m & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX), p
        assert not m & (stat.S_IWGRP | stat.S_IWOTH), p


# -- the agent's persist ------------------------------------------------------------------------


def test_absolute_path_with_setuid_mode_is_refused(run_dir: Path, tmp_path: Path, caplog) -> None:
    save, outside = tmp_path / "save", tmp_path / "outside"
    slot = _valid(run_dir, save)
    target = outside / "sbin" / "planted"
    pickle_span = slot.meta().files[0].pickle
    assert pickle_span is not None

    def plant(raw: dict) -> dict:
        raw["files"].append(_raw_entry(str(target), pickle_span.offset, 64, 0o4777))
        return raw

    _replace_meta(slot, plant)
    slot.close()
    with caplog.at_level(logging.WARNING):
        result = persist_slot(slot.path, step=5)
    assert not result.ok
    assert not target.exists() and not outside.exists(), "written outside the save directory"
    assert "absolute" in result.error
    assert [r for r in caplog.records if str(slot.path) in r.getMessage()], "names the slot"
    if save.exists():
        _no_loose_modes(save)


def test_dotdot_path_is_refused(run_dir: Path, tmp_path: Path) -> None:
    save = tmp_path / "save"
    slot = _valid(run_dir, save)
    span = slot.meta().files[0].pickle
    assert span is not None
    _replace_meta(slot, lambda raw: {**raw, "files": [
        *raw["files"], _raw_entry("global_step5/../../escaped", span.offset, 8)]})  # fmt: skip
    slot.close()
    result = persist_slot(slot.path, step=5)
    assert not result.ok and "'..'" in result.error
    assert not (tmp_path / "escaped").exists()


def test_modes_come_from_the_agent(run_dir: Path, tmp_path: Path) -> None:
    """A slot asking for mode 0o4777 on an ordinary relative file gets 0o644."""
    save = tmp_path / "save"
    slot = _valid(run_dir, save)
    span = slot.meta().files[0].pickle
    assert span is not None
    _replace_meta(slot, lambda raw: {**raw, "files": [
        *raw["files"], _raw_entry("tool.sh", span.offset, 8, 0o6777)]})  # fmt: skip
    slot.close()
    old = os.umask(0)
    try:
        result = persist_slot(slot.path, step=5)
    finally:
        os.umask(old)
    assert result.ok, result
    assert stat.S_IMODE(os.stat(save / "tool.sh").st_mode) == 0o644
    _no_loose_modes(save)


def test_symlink_planted_in_the_save_dir_is_not_followed(run_dir: Path, tmp_path: Path) -> None:
    save, outside = tmp_path / "save", tmp_path / "outside"
    save.mkdir()
    outside.mkdir()
    (save / "global_step5").symlink_to(outside)  # the step directory points elsewhere
    (save / ".diag").symlink_to(outside)  # and so does the marker directory
    slot = _valid(run_dir, save)
    slot.close()
    result = persist_slot(slot.path, step=5)
    assert not result.ok
    assert list(outside.iterdir()) == [], "nothing written through the link"
    assert not (save / "latest").exists()


# -- reading slot descriptions ------------------------------------------------------------------


def _first_file(raw: dict, **changes: object) -> dict:
    return {**raw, "files": [{**raw["files"][0], **changes}]}


GARBAGE = {
    "files-5": lambda raw: {**raw, "files": [5]},
    "files-not-a-list": lambda raw: {**raw, "files": {"a": 1}},
    "not-json": lambda raw: b"\xff{not json",
    "not-an-object": lambda raw: [1, 2, 3],
    "no-format": lambda raw: {k: v for k, v in raw.items() if k != "format"},
    "rank-a-string": lambda raw: {**raw, "rank": "0"},
    "rank-beyond-world": lambda raw: {**raw, "rank": 7},
    "huge-offset": lambda raw: _first_file(raw, pickle={"offset": 2**62, "length": 10}),
    "negative-length": lambda raw: _first_file(raw, pickle={"offset": 4096, "length": -1}),
    "storage-key-path": lambda raw: _first_file(
        raw, storages=[{"key": "../x", "offset": 4096, "nbytes": 1}]
    ),
    "relative-save-dir": lambda raw: {**raw, "save_dir": "ckpt"},
    "nested-deep": lambda raw: b"[" * 100000,
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_garbage_meta_is_skipped_with_one_warning(
    name: str, run_dir: Path, tmp_path: Path, caplog
) -> None:
    slot = _valid(run_dir, tmp_path / "save")
    good = _valid(run_dir, tmp_path / "save", job="k")
    _replace_meta(slot, GARBAGE[name])
    slot.close()
    good.close()
    manager = CheckpointManager(run_dir, None)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(3):  # every scan reads the slots again
                snaps = read_snapshots(find_slots(run_dir))
                manager.stats()
                manager.tick(time.time(), final=False)
        assert [s.meta.job for s in snaps] == ["k"], "the good slot is still read"
        named = [r for r in caplog.records if str(slot.path) in r.getMessage()]
        assert len(named) == 1, [r.getMessage() for r in caplog.records]
        assert "Traceback" not in caplog.text
        result = persist_slot(slot.path, step=5)
        assert not result.ok and str(slot.path) in result.error
    finally:
        manager.close(timeout=10)


def test_symlink_and_fifo_slots_are_refused(run_dir: Path, tmp_path: Path, caplog) -> None:
    good = _valid(run_dir, tmp_path / "save")
    good.close()
    link = slot_path(run_dir, "ln", 0, 0)
    link.symlink_to(good.path)
    fifo = slot_path(run_dir, "ff", 0, 0)
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING):
        snaps = read_snapshots(find_slots(run_dir))
    assert [s.path for s in snaps] == [good.path]
    assert str(link) in caplog.text and str(fifo) in caplog.text


# -- the trainer's load -------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _place(run_dir: Path, save: Path) -> Place:
    return Place(run_dir, "j", "node-a", 0, 1, str(save))


def _needed(tag: str) -> set[str]:
    return {f"{tag}/mp_rank_00_model_states.pt"}


def test_trainer_refuses_a_pickle_naming_os_system(run_dir: Path, tmp_path: Path, caplog) -> None:
    save, marker = tmp_path / "save", tmp_path / "ran"
    slot = new_slot(run_dir, "j", 0, 0)
    # What an attacker would write: os.system by its usual name (pickle itself says posix).
    pkl = pickle.dumps({"module": _Evil(marker)}, protocol=2).replace(b"cposix\n", b"cos\n")
    assert b"cos\nsystem" in pkl
    files = [CapturedFile(MODEL, "torch", pkl, [])]
    write_snapshot(slot, 5, files, job="j", rank=0, world=1, save_dir=save)
    place = _place(run_dir, save)
    index = memory_index(place, _needed)
    with caplog.at_level(logging.WARNING):
        failed = stage(place, 5, index[5], _needed("global_step5"))
    assert isinstance(failed, LoadFailure), "refused when read: the ranks agree on another step"
    assert failed.slot == slot.path and "os.system" in failed.reason
    assert [r for r in caplog.records if str(slot.path) in r.getMessage()]
    assert "os.system" in caplog.text
    entry = slot.meta().files[0]
    assert entry.pickle is not None
    with pytest.raises(RefusedGlobal, match=r"os\.system"):
        unpickle_state(
            slot.view(entry.pickle.offset, entry.pickle.length), lambda k: memoryview(b""),
            storages={}, budget=slot.capacity,
        )  # fmt: skip
    slot.close()
    assert not marker.exists(), "the pickle's command ran"


def test_trainer_loads_its_own_slots_only(run_dir: Path, tmp_path: Path) -> None:
    save = tmp_path / "save"
    slot = _valid(run_dir, save)
    slot.close()
    assert set(memory_index(_place(run_dir, save), _needed)) == {5}, "its own slot is offered"
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the slot to another user")
    os.chown(slot.path, NOBODY, NOBODY)
    assert memory_index(_place(run_dir, save), _needed) == {}


# -- end to end: the agent draining a run directory with planted slots ---------------------------


def _plant_as_nobody(run_dir: Path, staging: Path, save: Path) -> Path:
    """A process running as uid 65534 writes a complete slot (with a path into the save dir);
    it is then moved into the run directory (where that user may not create files)."""
    os.chown(staging, NOBODY, NOBODY)
    code = f"""
import os, sys
sys.path.insert(0, {str(SUPPORT / "replica")!r})
from pathlib import Path
import torch
from snapshot_helpers import captured, model_states, new_slot, write_snapshot
os.setgid({NOBODY}); os.setuid({NOBODY})
slot = new_slot(Path({str(staging)!r}), "other", 0, 0)
write_snapshot(slot, 7, captured({{"global_step7/mp_rank_00_model_states.pt": model_states(7)}}),
               job="other", rank=0, world=1, save_dir=Path({str(save)!r}))
slot.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    src = slot_path(staging, "other", 0, 0)
    assert os.stat(src).st_uid == NOBODY
    dst = slot_path(run_dir, "other", 0, 0)
    os.rename(src, dst)
    return dst


@root_only
def test_agent_drain_with_planted_slots_writes_nothing_outside(tmp_path: Path, run_dir) -> None:
    save, outside = tmp_path / "save", tmp_path / "outside"
    target = outside / "bin" / "planted"
    # A trusted (root, the agent's own user) slot whose description names an absolute path with
    # a setuid mode, beside a genuine snapshot of another job that must still be persisted.
    bad = _valid(run_dir, save, job="bad")
    span = bad.meta().files[0].pickle
    assert span is not None
    _replace_meta(bad, lambda raw: {**raw, "files": [
        _raw_entry(str(target), span.offset, 64, 0o4777)]})  # fmt: skip
    bad.close()
    _valid(run_dir, save, job="good", step=3).close()
    staging = Path(tempfile.mkdtemp(prefix="diag-test-staging-", dir="/dev/shm"))
    try:
        foreign = _plant_as_nobody(run_dir, staging, save)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log = tmp_path / "agent.log"
    cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
        "--timeline", str(tmp_path / "timeline"), "--native-stacks", "false",
        "--interval", "0.2", "--termination-grace", "20", "-v",
    ]  # fmt: skip
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "control channel on" not in log.read_text():
            assert agent.poll() is None, log.read_text()
            time.sleep(0.2)
        time.sleep(1.0)  # a few scans of the run directory
        agent.send_signal(signal.SIGTERM)  # a drain: persist every newest snapshot, then exit
        agent.wait(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    text = log.read_text()
    assert not target.exists() and not outside.exists(), "written outside the save directory"
    assert (save / "global_step3" / "mp_rank_00_model_states.pt").is_file(), text
    assert not (save / "global_step7").exists(), "the foreign slot was persisted"
    _no_loose_modes(save)
    assert str(foreign) in text and "owned by uid 65534" in text, text
    assert str(bad.path) in text and "absolute" in text, text
    assert "Traceback" not in text, text
