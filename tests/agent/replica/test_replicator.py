"""Two nodes' replicators on this machine, each holding the other's replica: the newest common
step is sent after each new one, and a node that comes back empty takes it back before its ranks
start; storage wins when it names a newer step."""

from __future__ import annotations

import shutil
import time

import pytest
from jobrun import free_port
from polling import wait_for
from replica_helpers import JOB, OWNERS, fill

from diag.agent.replica.replicator import (
    RETRY_MAX_S,
    NodeAddress,
    ReplicaSettings,
    Replicator,
    retry_delay,
)
from diag.agent.replica.ring import Source
from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import find_slots


@pytest.fixture
def two_nodes(tmp_path):
    nodes = tuple(NodeAddress(n, "127.0.0.1", free_port()) for n in ("a", "b"))
    settings = ReplicaSettings(nodes, factor=1, token="t", max_bytes=256 << 20, interval=0.1)
    made: list[Replicator] = []

    def make(node: str, storage_step=lambda: None) -> Replicator:
        run_dir = tmp_path / f"{node}-run"
        run_dir.mkdir(exist_ok=True)
        r = Replicator(settings, run_dir=run_dir, job=JOB, node=node, owners=OWNERS,
                       storage_step=storage_step)  # fmt: skip
        made.append(r)
        return r

    yield make, tmp_path
    for r in made:
        r.close()


def held(r: Replicator, node: str) -> int | None:
    return r.stats().held.get(node)


def test_each_node_holds_the_others_newest_step_and_an_empty_node_takes_it_back(two_nodes):
    make, tmp = two_nodes
    save = tmp / "save"
    a, b = make("a"), make("b")
    fill(a.run_dir, save, {0: [3], 1: [3]}, node="a")
    fill(b.run_dir, save, {2: [3], 3: [3]}, node="b")
    for r in (a, b):
        assert r.restore_at_start().source == Source.LOCAL
        r.start()
    assert wait_for(lambda: held(b, "a") == 3 and held(a, "b") == 3, 60)
    fill(a.run_dir, save, {0: [3, 4], 1: [3, 4]}, node="a")
    a.notify()
    assert wait_for(lambda: held(b, "a") == 4 and a.stats().sent_step == 4, 60)

    # node a is replaced: its ranks, its agent and its shared memory are gone
    a.close()
    shutil.rmtree(a.run_dir)
    a2 = make("a")
    choice = a2.restore_at_start()
    assert (choice.source, choice.step, choice.holder) == (Source.PEER, 4, "b")
    snaps = read_snapshots(find_slots(a2.run_dir, JOB), OWNERS)
    assert sorted((s.meta.rank, s.meta.step) for s in snaps) == [(0, 4), (1, 4)]
    assert a2.stats().restore == choice
    # the returning node holds its peer's replica again once it runs
    a2.start()
    assert wait_for(lambda: held(a2, "b") == 3, 60)


def test_storage_newer_than_the_replica_wins(two_nodes):
    make, tmp = two_nodes
    a, b = make("a"), make("b")
    fill(a.run_dir, tmp / "save", {0: [2], 1: [2]}, node="a")
    a.start()
    b.start()
    assert wait_for(lambda: held(b, "a") == 2, 60)
    a.close()
    shutil.rmtree(a.run_dir)
    a2 = make("a", storage_step=lambda: 5)
    choice = a2.restore_at_start()
    assert (choice.source, choice.step) == (Source.STORAGE, 5)
    assert not find_slots(a2.run_dir, JOB)


def test_no_holder_up_means_storage_or_nothing(two_nodes):
    make, _ = two_nodes
    a = make("a", storage_step=lambda: 7)
    choice = a.restore_at_start()
    assert (choice.source, choice.step) == (Source.STORAGE, 7)
    assert make("b").restore_at_start().source == Source.NONE


def test_the_pull_marker_is_gone_after_the_restore_stale_ones_too(two_nodes):
    from diag.formats.snapshot import pull_marker_path

    make, _ = two_nodes
    a = make("a", storage_step=lambda: 1)
    stale = pull_marker_path(a.run_dir, JOB)
    stale.touch()  # a killed agent's
    assert a.restore_at_start().source == Source.STORAGE
    assert not stale.exists()


def test_backoff_doubles_from_the_interval_up_to_a_cap():
    assert [retry_delay(n, 0.25) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert retry_delay(6, 0.25) == RETRY_MAX_S and retry_delay(10**6, 0.25) == RETRY_MAX_S


def test_a_holder_that_is_down_costs_a_try_now_and_then_and_one_warning(two_nodes, caplog):
    make, tmp_path = two_nodes
    a = make("a")
    fill(a.run_dir, tmp_path / "save", {0: [3], 1: [3]})
    caplog.set_level("DEBUG", logger="diag.agent.replica.replicator")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # b's agent is not there: 50 looks in a second
        assert not a.push_once()
        time.sleep(0.02)
    failures = a.stats().push_failures
    assert 1 <= failures <= 4, failures  # at 0, 0.2 and 0.6 s: the backoff doubles from 0.1 s
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "failed" in r.message]
    assert len(warned) == 1, [r.message for r in warned]

    b = make("b").start()  # b comes up: the push goes once the backoff is over
    assert wait_for(lambda: a.push_once() and held(b, "a") == 3, RETRY_MAX_S + 30)
    assert "the holder takes it again" in caplog.text
