"""A slot names its own save directory. When the ranks run as another user than the agent (a root
agent on a bare node), that directory is the ranks' user's input: the agent writes only into one
that user already owns, never creates one, never follows a symlink to it, and gives what it
creates there to that user (so the trainer can rewrite `latest` and remove old steps)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

from diag.agent.checkpoint.persist import PersistResult, persist_slot
from diag.agent.checkpoint.savedir import (
    AS_CONFIGURED,
    DirFacts,
    DirKind,
    SaveDirRule,
    refusal,
    rule_for,
)
from diag.formats.untrusted import Owners

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="diag-test-trust-savedir-run-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def area() -> Iterator[Path]:
    """A root-owned directory another user can traverse (pytest's temporary directories are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="diag-test-trust-savedir-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _persist_nobody_slot(
    run_dir: Path, save: Path, step: int = 5, index: int = 0, keep: int = 0
) -> PersistResult:
    """A complete slot of the ranks' user (uid 65534, trusted as such) naming `save`."""
    slot = new_slot(run_dir, "j", 0, index)
    files = captured({f"global_step{step}/mp_rank_00_model_states.pt": model_states(step)})
    write_snapshot(slot, step, files, job="j", rank=0, world=1, save_dir=save)
    slot.close()
    os.chown(slot.path, NOBODY, NOBODY)
    return persist_slot(slot.path, step=step, keep=keep, owners=Owners.of(NOBODY))


def _as_nobody(action) -> bool:  # type: ignore[no-untyped-def]
    """Runs `action()` in a child process running as uid 65534; True when it succeeded."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException as e:
            os.write(2, f"as uid {NOBODY}: {e}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


# -- the pure rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("from_operator", "slot_owner", "euid", "rule"),
    [
        (True, NOBODY, 0, AS_CONFIGURED),  # --save-dir: as the operator configured it
        (False, 0, 0, AS_CONFIGURED),  # a root trainer
        (False, 1000, 1000, AS_CONFIGURED),  # a pod: one user
        (False, NOBODY, 0, SaveDirRule(owner=NOBODY)),  # a bare node: root agent, user ranks
    ],
)
def test_rule_for(from_operator: bool, slot_owner: int, euid: int, rule: SaveDirRule) -> None:
    assert rule_for(from_operator=from_operator, slot_owner=slot_owner, agent_euid=euid) == rule


@pytest.mark.parametrize(
    ("facts", "word"),
    [
        (DirFacts(DirKind.MISSING), "does not exist"),
        (DirFacts(DirKind.SYMLINK, NOBODY), "symlink"),
        (DirFacts(DirKind.NOT_DIR, NOBODY), "not a directory"),
        (DirFacts(DirKind.DIR, 0), "owned by uid 0"),
        (DirFacts(DirKind.DIR, NOBODY), None),
    ],
)
def test_refusal(facts: DirFacts, word: str | None) -> None:
    problem = refusal(SaveDirRule(owner=NOBODY), facts)
    assert (problem is None) if word is None else (problem is not None and word in problem)
    assert refusal(AS_CONFIGURED, facts) is None


# -- the agent's persist ------------------------------------------------------------------------


@root_only
def test_slot_cannot_name_a_root_owned_save_dir(run_dir: Path, area: Path, caplog) -> None:
    save = area / "cron.d"  # root's, as /etc/cron.d is
    save.mkdir(mode=0o755)
    with caplog.at_level(logging.WARNING):
        result = _persist_nobody_slot(run_dir, save)
    assert not result.ok and "owned by uid 0" in result.error, result
    assert os.listdir(save) == [], "root wrote into a directory the slot's user does not own"
    warned = [r.getMessage() for r in caplog.records if str(save) in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "uid 0" in warned[0] and "--save-dir" in warned[0] and "65534" in warned[0]


@root_only
def test_slot_cannot_make_a_save_dir(run_dir: Path, area: Path) -> None:
    parent = area / "etc"
    parent.mkdir(mode=0o755)
    save = parent / "made" / "by" / "root"
    result = _persist_nobody_slot(run_dir, save)
    assert not result.ok and "does not exist" in result.error, result
    assert os.listdir(parent) == [], "root made directories a slot named"


@root_only
def test_symlinked_save_dir_is_refused(run_dir: Path, area: Path) -> None:
    real = area / "real"
    real.mkdir(mode=0o755)
    os.chown(real, NOBODY, NOBODY)
    link = area / "link"
    link.symlink_to(real)
    result = _persist_nobody_slot(run_dir, link)
    assert not result.ok and "symlink" in result.error, result
    assert os.listdir(real) == []


@root_only
def test_trainer_owned_save_dir_gets_trainer_owned_files(run_dir: Path, area: Path) -> None:
    save = area / "ckpt"
    save.mkdir(mode=0o755)
    os.chown(save, NOBODY, NOBODY)
    for index, step in enumerate((5, 6)):  # the second prunes the first (keep 1)
        result = _persist_nobody_slot(run_dir, save, step, index, keep=1)
        assert result.ok and result.committed, result
    made = list(save.rglob("*"))
    assert (save / "latest").is_file() and (save / "global_step6").is_dir(), made
    assert not (save / "global_step5").exists() and (save / ".diag" / "commit.lock").exists()
    foreign = [str(p) for p in made if os.lstat(p).st_uid != NOBODY or os.lstat(p).st_gid != NOBODY]
    assert foreign == [], "created there but not given to the save directory's owner"

    def rewrite_latest() -> None:  # what DeepSpeed's next save_checkpoint does
        with open(save / "latest", "w") as f:
            f.write("global_step7")

    assert _as_nobody(rewrite_latest), "the trainer cannot rewrite `latest`"
    assert (save / "latest").read_text() == "global_step7"
    assert _as_nobody(lambda: shutil.rmtree(save / "global_step6")), "cannot remove an old step"


@root_only
def test_operator_save_dir_is_used_as_configured(run_dir: Path, area: Path) -> None:
    """--save-dir is the operator's: made when missing, whoever's slot it is."""
    save = area / "operator" / "ckpt"
    slot = new_slot(run_dir, "j", 0, 0)
    files = captured({"global_step5/mp_rank_00_model_states.pt": model_states(5)})
    write_snapshot(slot, 5, files, job="j", rank=0, world=1, save_dir=area / "elsewhere")
    slot.close()
    os.chown(slot.path, NOBODY, NOBODY)
    result = persist_slot(slot.path, step=5, save_dir=save, owners=Owners.of(NOBODY))
    assert result.ok and result.committed, result
    assert (save / "global_step5" / "mp_rank_00_model_states.pt").is_file()
    assert not (area / "elsewhere").exists()
