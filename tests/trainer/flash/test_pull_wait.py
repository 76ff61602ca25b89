"""A rank looking for snapshots waits while its agent pulls the node's replica from a peer (the
agent's marker in the run directory), never longer than the bound, and ignores a marker that is
not a regular file of a trusted user."""

from __future__ import annotations

import os
import threading
import time

from diag.formats.snapshot import pull_marker_path
from diag.trainer.flash.restore import Place, wait_for_pull


def place(tmp_path) -> Place:
    return Place(tmp_path, "j", "n0", 0, 2, "/save")


def test_no_marker_no_wait(tmp_path):
    t0 = time.monotonic()
    assert wait_for_pull(place(tmp_path), timeout=5)
    assert time.monotonic() - t0 < 1


def test_waits_until_the_agent_removes_its_marker(tmp_path):
    marker = pull_marker_path(tmp_path, "j")
    marker.touch()
    gone = threading.Event()

    def pull_done() -> None:
        time.sleep(0.3)
        marker.unlink()
        gone.set()

    threading.Thread(target=pull_done).start()
    assert wait_for_pull(place(tmp_path), timeout=60)
    assert gone.is_set()


def test_a_marker_left_by_a_killed_agent_costs_the_bound_only(tmp_path):
    pull_marker_path(tmp_path, "j").touch()
    t0 = time.monotonic()
    assert not wait_for_pull(place(tmp_path), timeout=0.3)
    assert time.monotonic() - t0 >= 0.3


def test_a_planted_link_is_no_marker(tmp_path):
    os.symlink(tmp_path / "elsewhere", pull_marker_path(tmp_path, "j"))
    assert wait_for_pull(place(tmp_path), timeout=60)
