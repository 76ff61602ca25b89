"""The replica store's directory as a trainer can leave it, since by default it lies in the run
directory the trainer writes (finding A1 of the security review, its store part): a planted
symlink is refused, not followed; a directory of another user or one open to others is refused;
only entries named as the store names its own are ever removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobrun import free_port
from polling import catches_sigterm, wait_for
from replica_helpers import CAP, TOKEN

from diag.agent.replica.store import ReplicaStore
from diag.formats.exitcodes import UsageError


def victim(root: Path) -> Path:
    """A directory the trainer wants emptied: subdirectories, dot-dirs, one named like a
    replica."""
    root.mkdir()
    for name in ("keep", ".ssh", ".git", "a-1-0123abcd", ".in-a-0123abcd"):
        (root / name).mkdir()
        (root / name / "file").write_text("mine")
    return root


def intact(root: Path) -> bool:
    return all(
        (root / name / "file").read_text() == "mine"
        for name in ("keep", ".ssh", ".git", "a-1-0123abcd", ".in-a-0123abcd")
    )


def test_a_planted_symlink_in_place_of_the_store_is_refused_and_its_target_untouched(tmp_path):
    target = victim(tmp_path / "elsewhere")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / ".replicas").symlink_to(target)
    with pytest.raises(UsageError, match="symlink"):
        ReplicaStore(run_dir / ".replicas", CAP)
    assert intact(target)


def test_only_the_stores_own_entries_are_removed(tmp_path):
    store_dir = tmp_path / "replicas"
    store_dir.mkdir(mode=0o700)
    for name in ("notes", ".git"):
        (store_dir / name).mkdir()
        (store_dir / name / "file").write_text("mine")
    outside = victim(tmp_path / "outside")
    (store_dir / "b-3-0123abcd").symlink_to(outside)  # named like a replica, a link
    (store_dir / ".in-b-89abcdef").mkdir()  # a dead agent's staging directory: ours
    (store_dir / "b-4-456789ab").mkdir()  # a replica without its manifest: ours
    foreign = store_dir / "b-5-fedcba98"
    foreign.mkdir()
    (foreign / "not-a-part").write_text("mine")  # ours by name, holding what is not
    store = ReplicaStore(store_dir, CAP)
    store.close()
    left = sorted(p.name for p in store_dir.iterdir())
    assert left == [".git", "b-3-0123abcd", "b-5-fedcba98", "notes"], left
    assert (store_dir / ".git" / "file").read_text() == "mine"
    assert (foreign / "not-a-part").read_text() == "mine"
    assert intact(outside)


@pytest.mark.parametrize("problem", ["open to others", "another user's"])
def test_a_store_dir_that_is_not_the_agents_own_is_refused(tmp_path, problem):
    store_dir = victim(tmp_path / "replicas")
    if problem == "open to others":
        store_dir.chmod(0o755)
        match = "mode 0755"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory to another user")
        store_dir.chmod(0o700)
        os.chown(store_dir, 65534, 65534)
        match = "owned by uid 65534"
    with pytest.raises(UsageError, match=match):
        ReplicaStore(store_dir, CAP)
    assert intact(store_dir)


def test_the_agent_exits_2_on_a_planted_store_and_deletes_nothing(tmp_path):
    """End to end, finding A1: a `.replicas` link planted in the run directory. The store lives
    in the agent's own state directory now, so the link is not even looked at: the agent starts
    and the target is intact. Named as --replica-dir, the link is refused with exit 2."""
    target = victim(tmp_path / "elsewhere")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / ".replicas").symlink_to(target)
    ring = f"a=127.0.0.1:{free_port()},b=127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIAG_")}
    env["DIAG_REPLICA_TOKEN"] = TOKEN
    cmd = [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
           "--timeline", str(tmp_path / "timeline"), "--job", "rj", "--node", "a",
           "--replica-nodes", ring, "--replica-listen", "127.0.0.1", "--native-stacks",
           "false", "--state-dir", str(tmp_path / "state")]  # fmt: skip
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: catches_sigterm(agent.pid) or agent.poll() is not None, 60)
        time.sleep(2.0)  # its start-up, the store's sweep of what a dead agent left included
        assert agent.poll() is None, agent.communicate()[0].decode(errors="replace")
    finally:
        agent.terminate()
        agent.communicate(timeout=30)
    assert intact(target)
    agent = subprocess.Popen(
        [*cmd, "--replica-dir", str(run_dir / ".replicas")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
    text = out.decode(errors="replace")
    assert agent.returncode == 2, text
    assert "replica directory" in text and "symlink" in text and "Traceback" not in text, text
    assert intact(target)
