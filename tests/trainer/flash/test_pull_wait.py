"""A rank looking for snapshots waits while its agent pulls the node's replica from a peer (the
agent's marker in the run directory), never longer than the bound, and ignores a marker that is
not a regular file of a trusted user. With DIAG_AGENT_WAIT, a rank on an empty node first waits
for its agent to be up at all (a pod's containers start together)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import pull_marker_path, writing_marker_path
from diag.trainer.flash.restore import (
    AGENT_WAIT_ENV,
    Place,
    agent_is_up,
    agent_wait_from_env,
    memory_index,
    wait_for_agent,
    wait_for_pull,
    wait_for_writing,
)


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


# -- an empty node's rank waits for its agent to be up (DIAG_AGENT_WAIT) ---------------------------


def waiting_place(tmp_path, seconds: float) -> Place:
    return Place(tmp_path, "j", "n0", 0, 2, "/save", agent_wait=seconds)


def serve_later(path, delay: float, ready: threading.Event) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def bind() -> None:
        time.sleep(delay)
        sock.bind(str(path))
        sock.listen(1)
        ready.set()

    threading.Thread(target=bind).start()
    return sock


def test_an_empty_node_waits_for_its_agent_control_socket(tmp_path):
    ready = threading.Event()
    sock = serve_later(control_socket_path(tmp_path, "j"), 0.3, ready)
    try:
        assert memory_index(waiting_place(tmp_path, 60), lambda tag: set()) == {}
        assert ready.is_set(), "returned before the agent was up"
    finally:
        sock.close()


def test_no_agent_costs_the_bound_and_says_so(tmp_path, caplog):
    t0 = time.monotonic()
    assert not wait_for_agent(waiting_place(tmp_path, 0.3), 0.3)
    assert time.monotonic() - t0 >= 0.3
    assert "no agent came up" in caplog.text and AGENT_WAIT_ENV in caplog.text


def test_a_planted_file_or_link_is_no_agent(tmp_path):
    control_socket_path(tmp_path, "j").write_text("")  # not a socket
    os.symlink(tmp_path / "elsewhere", control_socket_path(tmp_path, None))
    assert not agent_is_up(waiting_place(tmp_path, 1))


def test_a_pulling_agent_counts_as_up(tmp_path):
    pull_marker_path(tmp_path, "j").touch()
    assert agent_is_up(waiting_place(tmp_path, 1))


def test_a_node_holding_snapshots_does_not_wait(tmp_path):
    slot = new_slot(tmp_path, "j", 0, 0, world=2)
    try:
        write_snapshot(slot, 3, captured({"global_step3/x.pt": model_states(3)}), job="j",
                       rank=0, world=2, save_dir=Path("/save"), node="n0", run="r1")  # fmt: skip
    finally:
        slot.close()
    t0 = time.monotonic()
    memory_index(waiting_place(tmp_path, 30), lambda tag: {f"{tag}/x.pt"})
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, 0.0), ("", 0.0), ("60", 60.0), (" 2.5 ", 2.5), ("0", 0.0)]
)
def test_agent_wait_from_env(value, seconds):
    env = {} if value is None else {AGENT_WAIT_ENV: value}
    assert agent_wait_from_env(env) == seconds


@pytest.mark.parametrize("value", ["soon", "-1", "1e9", "nan"])
def test_a_bad_agent_wait_names_the_variable_and_the_range(value):
    with pytest.raises(ValueError, match=rf"{AGENT_WAIT_ENV}=.*0 to 3600"):
        agent_wait_from_env({AGENT_WAIT_ENV: value})


# -- a rank about to resume from storage waits while its agent writes the newest step -------------


def test_waits_while_the_agent_writes_the_newest_step(tmp_path):
    marker = writing_marker_path(tmp_path, "j")
    marker.touch()
    gone = threading.Event()

    def written() -> None:
        time.sleep(0.3)
        marker.unlink()
        gone.set()

    threading.Thread(target=written).start()
    assert wait_for_writing(place(tmp_path), timeout=60)
    assert gone.is_set()


def test_a_writing_mark_left_by_a_killed_agent_costs_the_bound_only(tmp_path, caplog):
    writing_marker_path(tmp_path, "j").touch()
    assert not wait_for_writing(place(tmp_path), timeout=0.3)
    assert "write the newest step to storage" in caplog.text


def test_a_planted_writing_link_is_no_mark(tmp_path):
    os.symlink(tmp_path / "elsewhere", writing_marker_path(tmp_path, "j"))
    assert wait_for_writing(place(tmp_path), timeout=60)
