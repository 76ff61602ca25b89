"""Pairing rounds and isolation, driven end to end through the pure core with plain numbers.

`simulate` plays a whole precheck against a model network: each node is healthy, slow (its
link runs at 12 MB/s) or down (every collective with it fails), healthy links run at 800 MB/s
with deterministic jitter. The planner picks pairs from the results so far, as the coordinator
does; `classify` then names the nodes.
"""

from __future__ import annotations

import pytest

from diag.agent.node.linkstate import NicState
from diag.agent.precheck.classify import Observations, classify
from diag.agent.precheck.grading import Thresholds
from diag.agent.precheck.measurements import LocalEvidence, PairResult, Severity
from diag.agent.precheck.rounds import base_pairs, plan_round, required_partners

FAST = 800e6
SLOW = 12e6


def _jitter(a: int, b: int, r: int) -> float:
    # 0.75 .. 1.39, fixed per (pair, round): healthy links differ by up to 1.85x.
    return 0.75 + ((a * 7 + b * 13 + r * 5) % 9) * 0.08


def simulate(
    n: int,
    bad: dict[int, str],
    th: Thresholds | None = None,
    local: dict[int, LocalEvidence] | None = None,
    max_rounds: int = 5,
):
    th = th or Thresholds()
    nodes = list(range(n))
    history: list[PairResult] = []
    rounds: list[list[tuple[int, int]]] = []
    r = 1
    while True:
        pairs = plan_round(nodes, history, r, th, max_rounds)
        if not pairs:
            break
        for a, b in pairs:
            kinds = {bad.get(a), bad.get(b)}
            if "down" in kinds:
                history.append(PairResult(r, a, b, None, "timed out after 5 s"))
            elif "slow" in kinds:
                history.append(PairResult(r, a, b, SLOW * _jitter(a, b, r) / 1.4))
            else:
                history.append(PairResult(r, a, b, FAST * _jitter(a, b, r)))
        rounds.append(pairs)
        r += 1
    obs = Observations(nnodes=n, joined=frozenset(nodes), pairs=tuple(history), local=local or {})
    return classify(obs, th), rounds, history


def _statuses(a):
    return (
        a.nodes_with(Severity.FAULTY),
        a.nodes_with(Severity.STRAGGLER),
        a.nodes_with(Severity.SUSPECT),
    )


@pytest.mark.parametrize(
    ("n", "pairs_round1", "pairs_round2"),
    [
        (2, [(0, 1)], []),
        (3, [(0, 1)], [(1, 2)]),
        (4, [(0, 1), (2, 3)], [(1, 2), (3, 0)]),
        (5, [(0, 1), (2, 3)], [(1, 2), (3, 4)]),
        (6, [(0, 1), (2, 3), (4, 5)], [(1, 2), (3, 4), (5, 0)]),
    ],
)
def test_base_pairs(n, pairs_round1, pairs_round2):
    nodes = list(range(n))
    assert base_pairs(nodes, 1) == pairs_round1
    assert base_pairs(nodes, 2) == pairs_round2
    assert base_pairs(nodes, 3) == []


@pytest.mark.parametrize(("n", "required"), [(1, 0), (2, 1), (3, 2), (8, 2)])
def test_required_partners(n, required):
    assert required_partners(n) == required


@pytest.mark.parametrize(
    ("n", "rounds"),
    [(2, 1), (3, 3), (4, 2), (5, 3), (6, 2), (7, 3), (8, 2), (16, 2)],
)
def test_healthy_runs_name_nobody_and_use_few_rounds(n, rounds):
    assessment, planned, history = simulate(n, {})
    assert _statuses(assessment) == ([], [], [])
    assert len(planned) == rounds
    for pairs in planned:  # a node is in at most one pair per round
        flat = [x for p in pairs for x in p]
        assert len(flat) == len(set(flat))
    tested = [frozenset((p.a, p.b)) for p in history]
    assert len(tested) == len(set(tested))  # never the same pair twice
    for node in range(n):  # everyone has min(2, n-1) distinct partners
        partners = {p.other(node) for p in history if p.has(node)}
        assert len(partners) >= required_partners(n)


def test_three_nodes_test_every_pair():
    _, planned, _ = simulate(3, {})
    assert sorted(tuple(sorted(p)) for r in planned for p in r) == [(0, 1), (0, 2), (1, 2)]


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("kind", ["slow", "down"])
def test_one_bad_node_is_isolated_at_every_position(n, kind):
    for bad in range(n):
        assessment, planned, _ = simulate(n, {bad: kind})
        faulty, stragglers, suspects = _statuses(assessment)
        expected = [bad]
        assert (faulty, stragglers, suspects) == (
            (expected, [], []) if kind == "down" else ([], expected, [])
        ), (n, bad, planned)
        verdict = assessment.verdicts[bad]
        assert verdict.reason  # says why, with the numbers
        if kind == "slow":
            assert "MB/s" in verdict.reason and "median" in verdict.reason


def test_straggler_reason_carries_measured_and_median_bandwidth():
    assessment, _, _ = simulate(3, {1: "slow"})
    v = assessment.verdicts[1]
    assert v.busbw is not None and v.busbw < 13e6
    assert assessment.median_busbw is not None and assessment.median_busbw > 400e6
    assert v.reason.startswith("busbw ")
    assert "best with nodes 0, 2" in v.reason


@pytest.mark.parametrize(
    ("n", "bad", "faulty", "stragglers"),
    [
        (4, {0: "slow", 1: "slow"}, [], [0, 1]),  # the two bad ones start out as partners
        (6, {1: "slow", 4: "down"}, [4], [1]),
        (8, {2: "down", 3: "down"}, [2, 3], []),
        (8, {0: "down", 5: "slow", 7: "slow"}, [0], [5, 7]),
    ],
)
def test_several_bad_nodes(n, bad, faulty, stragglers):
    assessment, _, _ = simulate(n, bad)
    assert _statuses(assessment) == (faulty, stragglers, [])


@pytest.mark.parametrize("kind", ["slow", "down"])
def test_two_nodes_cannot_pin_a_bad_link_on_either_side(kind):
    # A floor makes the slow link visible at all: with 2 nodes the median is the link itself.
    th = Thresholds(min_busbw=100e6)
    assessment, planned, _ = simulate(2, {1: kind}, th)
    assert planned == [[(0, 1)]]
    assert _statuses(assessment) == ([], [], [0, 1])
    assert "with 2 nodes" in assessment.verdicts[0].reason


def test_two_nodes_slow_link_without_floor_is_not_judged():
    assessment, _, _ = simulate(2, {1: "slow"})
    assert _statuses(assessment) == ([], [], [])


def test_two_nodes_own_evidence_names_the_side():
    # Node 1 sees no carrier on its own NIC: the failed link is explained by node 1 alone.
    local = {
        0: LocalEvidence(node=0, nic=NicState(iface="eth0", carrier=True, operstate="up")),
        1: LocalEvidence(node=1, nic=NicState(iface="eth0", carrier=False, operstate="down")),
    }
    assessment, _, _ = simulate(2, {1: "down"}, local=local)
    assert _statuses(assessment) == ([1], [], [])
    assert "no carrier" in assessment.verdicts[1].reason


def test_round_limit_leaves_unresolved_nodes_as_suspects():
    # With a single round allowed, node 3's bad link to node 2 cannot be re-tested.
    assessment, planned, _ = simulate(4, {3: "down"}, max_rounds=1)
    assert len(planned) == 1
    assert _statuses(assessment) == ([], [], [2, 3])


def test_noisy_healthy_links_within_ratio_are_not_stragglers():
    # Jitter spans 0.75x..1.39x, under the 2x the default ratio allows: nothing is flagged.
    for n in range(2, 9):
        assessment, _, _ = simulate(n, {})
        assert _statuses(assessment) == ([], [], [])
