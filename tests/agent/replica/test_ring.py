"""The replica ring's placement and choices, table-driven."""

from __future__ import annotations

import pytest

from diag.agent.replica.ring import (
    Held,
    Offer,
    Ring,
    RingError,
    Source,
    accepts,
    choose_restore,
    step_to_send,
)

NODES = ("n0", "n1", "n2", "n3")


@pytest.mark.parametrize(
    ("factor", "node", "holders", "held_by"),
    [
        (1, "n0", ("n1",), ("n3",)),
        (1, "n3", ("n0",), ("n2",)),
        (2, "n1", ("n2", "n3"), ("n0", "n3")),
        (3, "n0", ("n1", "n2", "n3"), ("n3", "n2", "n1")),
        (9, "n0", ("n1", "n2", "n3"), ("n3", "n2", "n1")),  # capped at n-1: never itself
        (0, "n2", (), ()),
    ],
)
def test_ring_placement(factor, node, holders, held_by):
    ring = Ring.of(NODES, factor)
    assert ring.holders(node) == holders
    assert ring.held_by(node) == held_by


def test_every_node_is_held_factor_times_and_holds_factor_replicas():
    ring = Ring.of([f"n{i}" for i in range(7)], 2)
    held = {n: 0 for n in ring.nodes}
    for n in ring.nodes:
        assert n not in ring.holders(n)
        for h in ring.holders(n):
            held[h] += 1
            assert n in ring.held_by(h)
    assert set(held.values()) == {2}


def test_a_single_node_holds_nothing():
    ring = Ring.of(["solo"], 1)
    assert ring.holders("solo") == () and ring.held_by("solo") == ()


@pytest.mark.parametrize(
    ("nodes", "factor", "problem"),
    [(("a", "a"), 1, "twice"), (("a", ""), 1, "empty"), (("a", "b"), -1, "0 or more")],
)
def test_bad_rings_are_refused(nodes, factor, problem):
    with pytest.raises(RingError, match=problem):
        Ring.of(nodes, factor)


def test_an_unknown_node_is_named():
    with pytest.raises(RingError, match="'zz' is not one of"):
        Ring.of(NODES, 1).holders("zz")


@pytest.mark.parametrize(
    ("held", "want"),
    [
        ([], None),
        ([Held(0, 5, "a"), Held(1, 5, "a")], (5, "a")),
        ([Held(0, 5, "a"), Held(0, 6, "a"), Held(1, 5, "a"), Held(1, 6, "a")], (6, "a")),
        # rank 1 is mid-copy of step 6: step 5 is the newest on both
        ([Held(0, 5, "a"), Held(0, 6, "a"), Held(1, 5, "a")], (5, "a")),
        # the same step from two launches is not one step
        ([Held(0, 5, "a"), Held(1, 5, "b")], None),
        ([Held(0, 5, "a")], None),  # rank 1 holds nothing
    ],
)
def test_step_to_send(held, want):
    assert step_to_send([0, 1], held) == want


def offer(holder, step, ranks=(0, 1), run="r"):
    return Offer(holder, step, run, 4, ranks)


@pytest.mark.parametrize(
    ("local", "offers", "storage", "source", "step", "holder"),
    [
        ([7], [offer("n1", 9)], 3, Source.LOCAL, 7, None),  # memory survived: a process restart
        ([], [offer("n1", 9)], 3, Source.PEER, 9, "n1"),
        ([], [offer("n1", 9)], None, Source.PEER, 9, "n1"),
        ([], [offer("n1", 9)], 9, Source.PEER, 9, "n1"),  # a tie: memory is faster
        ([], [offer("n1", 9)], 10, Source.STORAGE, 10, None),  # never a replica over newer
        ([], [offer("n1", 8), offer("n2", 9)], 3, Source.PEER, 9, "n2"),
        ([], [offer("n2", 9), offer("n1", 9)], 3, Source.PEER, 9, "n1"),  # the first holder
        ([], [offer("n1", 9, ranks=(0,))], 3, Source.STORAGE, 3, None),  # a rank missing
        ([], [offer("n1", 9, ranks=(0,))], None, Source.NONE, None, None),
        ([], [], 4, Source.STORAGE, 4, None),
        ([], [], None, Source.NONE, None, None),
    ],
)
def test_choose_restore(local, offers, storage, source, step, holder):
    c = choose_restore(
        local_steps=local, offers=offers, storage_step=storage, ranks=(0, 1), holders=("n1", "n2")
    )
    assert (c.source, c.step, c.holder) == (source, step, holder)
    assert c.reason


@pytest.mark.parametrize(
    ("current", "step", "run", "want"),
    [
        (None, 3, "a", True),
        (offer("h", 3, run="a"), 4, "a", True),
        (offer("h", 3, run="a"), 3, "a", False),
        (offer("h", 5, run="a"), 3, "b", True),  # the ranks resumed from an older step
        (offer("h", 5, run="a"), 3, "a", True),
    ],
)
def test_accepts(current, step, run, want):
    assert accepts(current, step, run) is want
