"""SIGKILL of the trainer ranks, the agent, both, or the whole node (both, and its shared memory
with them) during save, copy, persist and commit, on real 2-rank DeepSpeed jobs and a real agent
(killsuite.py); with a replica in a peer, node kills mid-push and the holder's agent killed
mid-receive too, one stage with the node and the holder in network namespaces. Across the three
stages every target meets every phase once but the node, which meets three;
bench/kill_bench.py runs hundreds of random kills."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from holderkill import kill_holder
from killsuite import KillSuite
from netlab import netns_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# stage -> (target, phase, mode, fraction of the phase)
KILLS = {
    1: [("trainer", "save", "tick", 0.5), ("agent", "copy", "timer", 0.5),
        ("both", "persist", "timer", 0.3), ("trainer", "commit", "tick", 0.6),
        ("node", "persist", "timer", 0.5)],
    2: [("agent", "save", "timer", 0.5), ("both", "copy", "tick", 0.5),
        ("trainer", "persist", "tick", 0.4), ("agent", "commit", "timer", 0.5),
        ("node", "commit", "tick", 0.5)],
    3: [("both", "save", "tick", 0.7), ("trainer", "copy", "timer", 0.5),
        ("agent", "persist", "tick", 0.5), ("both", "commit", "tick", 0.4),
        ("node", "copy", "timer", 0.5)],
}  # fmt: skip


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(prefix="diag-test-kill-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# Stage 2's kills hit every target (trainer, agent, both, node) and every phase (save, copy,
# persist, commit): the default tier runs it, less the agent's kill at the commit (a node's kill
# there kills its agent too); stages 1 and 3, the other pairings, are the long tier.
DEFAULT_KILLS = [k for k in KILLS[2] if k[:2] != ("agent", "commit")]


@pytest.mark.parametrize(
    "zero", [pytest.param(z, marks=[] if z == 2 else [pytest.mark.long]) for z in sorted(KILLS)]
)
def test_kills_lose_nothing_committed_or_in_memory(root: Path, zero: int, long_tier: bool) -> None:
    suite = KillSuite(root, zero)
    try:
        suite.start()
        for target, phase, mode, fraction in KILLS[zero] if long_tier else DEFAULT_KILLS:
            r = suite.kill(target, phase, mode, fraction)
            assert not r.problems, (r, suite.tail())
            assert r.phase == phase, f"the kill of {target} aimed at {phase} fired in: {r}"
            if r.restored is not None:
                assert r.bound is None or r.restored >= r.bound, r
                if target == "node" and r.restored:
                    assert r.source == "storage", r
            else:
                assert r.committed_after is not None and r.committed_after > (
                    r.memory_at_kill or 0
                ), r
        assert len(suite.watch.seen) >= 3, "latest moved forward through the kills"
    finally:
        suite.close()
    assert not suite.watch.problems


# A node killed and wiped while a second agent holds its replica (the next node of the ring),
# the job persisting every 10th step only: its ranks restore exactly the replica the holder held
# whole at the kill (or storage's newer step), and a kill in the middle of the node's push leaves
# the holder its previous replica, the one restored; the holder's agent killed as it takes a push
# leaves a whole replica, and restarted takes the node's next. The long tier: the default tier has
# the replicate phase's kill mid-push against a real holder (tests/agent/replica/
# test_replicate_kill.py) and the pull and restore through real agents in network namespaces
# (test_replica_netns).
REPLICA_KILLS = {
    1: [("node", "save", "timer", 0.5), ("node", "replicate", "tick", 0.7),
        ("node", "persist", "tick", 0.5)],
    2: [("node", "copy", "timer", 0.5), ("node", "replicate", "timer", 0.5),
        ("holder", "receive", "tick", 0.5), ("node", "commit", "tick", 0.5)],
    3: [("node", "replicate", "tick", 0.5), ("node", "persist", "timer", 0.3),
        ("node", "save", "tick", 0.6)],
}  # fmt: skip


# Stage 2 (its holder kill among them) runs the node and the holder as two network namespaces
# joined by veth links: the pushes and the pull cross the links, as between two machines.
@pytest.mark.parametrize(
    ("zero", "netns"),
    [
        pytest.param(1, False, marks=[pytest.mark.long], id="1"),
        pytest.param(2, True, marks=[pytest.mark.long, pytest.mark.netns], id="2-netns"),
        pytest.param(3, False, marks=[pytest.mark.long], id="3"),
    ],
)
def test_node_kills_restore_from_the_replica_in_a_peer(root: Path, zero: int, netns: bool) -> None:
    if netns and (reason := netns_unavailable()):
        pytest.skip(reason)
    suite = KillSuite(root, zero, replicas=True, netns=netns)
    try:
        suite.start()
        for target, phase, mode, fraction in REPLICA_KILLS[zero]:
            if target == "holder":
                r = kill_holder(suite, phase, mode, fraction)
                assert not r.problems and r.phase == phase, (r, suite.tail())
                assert r.replica_after is not None and r.replica_after > r.fired_step, r
                continue
            r = suite.kill(target, phase, mode, fraction)
            assert not r.problems, (r, suite.tail())
            assert r.replica_at_kill is not None, r
            expect = max(r.replica_at_kill, r.latest_at_kill or 0)
            assert r.restored == expect, r
            if phase == "replicate":
                assert r.phase == "replicate" and r.source == "memory", r
                # the push cut: the holder kept the previous replica; at most the step in flight
                # (the one being pushed) is lost
                assert r.replica_at_kill <= r.fired_step, r
    finally:
        suite.close()
    assert not suite.watch.problems
