"""The shared timeline is hostile input: every node's agent and the trainers write it, so what
is there may be a link, a FIFO, garbage or a fake. The agent's start-up write probe goes through
a descriptor of the timeline and touches nothing it did not make.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from children import terminate
from polling import catches_sigterm, wait_for

from diag.formats.incidentdir import probe_timeline

pytestmark = pytest.mark.timeout(60)

DIAG = [sys.executable, "-m", "diag.cli.main"]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file the agent must never write, chmod or truncate (root's, in a real attack)."""
    p = tmp_path / "outside" / "victim"
    p.parent.mkdir()
    p.write_bytes(b"root's data\n")
    p.chmod(0o644)
    return p


# -- A3: the start-up write probe ---------------------------------------------------------------


@pytest.mark.timeout(90)
def test_write_probe_truncates_nothing_a_timeline_writer_planted(
    tmp_path: Path, victim: Path
) -> None:
    real = tmp_path / "volume"
    real.mkdir()
    planted = real / ".diag-write-test"
    planted.symlink_to(victim)
    timeline = tmp_path / "timeline"
    timeline.symlink_to(real)  # the operator's mount point: the root may be a symlink
    agent = subprocess.Popen(
        [*DIAG, "agent", "--run-dir", str(tmp_path / "run"), "--timeline", str(timeline),
         "--node", "n1", "--control", "false", "--drain", "false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # It installs its SIGTERM handler after the probe: then the probe is done.
        wait_for(lambda: catches_sigterm(agent.pid) or agent.poll() is not None, timeout=60)
        assert agent.poll() is None, agent.communicate(timeout=10)[0]
    finally:
        terminate(agent, timeout=20)
    out = agent.stdout.read() if agent.stdout else ""
    assert victim.read_bytes() == b"root's data\n", out
    assert victim.stat().st_mode & 0o777 == 0o644
    assert planted.is_symlink()  # not the probe's to remove
    assert sorted(p.name for p in real.iterdir()) == [".diag-write-test"], out


def test_write_probe_follows_the_root_only(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "volume").mkdir()
    (tmp_path / "volume" / ".diag-write-test").symlink_to(victim)
    (tmp_path / "timeline").symlink_to(tmp_path / "volume")
    probe_timeline(tmp_path / "timeline")
    probe_timeline(tmp_path / "new" / "timeline")  # made when missing
    assert victim.read_bytes() == b"root's data\n"
    assert [p.name for p in (tmp_path / "volume").iterdir()] == [".diag-write-test"]
    assert list((tmp_path / "new" / "timeline").iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        probe_timeline(tmp_path / "file")
