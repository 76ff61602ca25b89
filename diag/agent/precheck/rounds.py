"""Which nodes test their link together in each round.

Each round is a set of disjoint pairs that run at the same time. The plan:

- Round 1 pairs neighbours in rank order, (0,1), (2,3), ...; round 2 shifts by one, (1,2),
  (3,4), ..., so that with an even count of nodes every node has two distinct partners after
  two rounds.
- Every later round (and the nodes a base round left idle) is planned from the results so far:
  a node that has fewer than two distinct partners (one with 2 nodes), or that has no good pair
  and fewer than two failing partners who did pass with someone else, is paired with a partner
  it has not met, preferring partners that passed. With 3 nodes this ends up testing every pair.
- Planning stops when no node needs another partner, no untested partner is left, or the round
  limit is reached.

Lost nodes are simply left out of `nodes`; pairs with them do not count for anyone.
"""

from __future__ import annotations

from collections.abc import Sequence

from diag.agent.precheck.grading import Grade, Thresholds, grade_pairs
from diag.agent.precheck.measurements import PairResult

Pair = tuple[int, int]


def required_partners(node_count: int) -> int:
    """How many distinct partners isolate a node: two, or one when only two nodes take part."""
    return max(0, min(2, node_count - 1))


def base_pairs(nodes: Sequence[int], round_index: int) -> list[Pair]:
    """Round 1: (n0,n1), (n2,n3), ...; round 2: (n1,n2), (n3,n4), ... closing the ring when
    the count is even and at least 4. Later rounds have no base pairs."""
    m = len(nodes)
    if round_index == 1:
        return [(nodes[i], nodes[i + 1]) for i in range(0, m - 1, 2)]
    if round_index == 2 and m >= 3:
        pairs = [(nodes[i], nodes[i + 1]) for i in range(1, m - 1, 2)]
        if m % 2 == 0 and m >= 4:
            pairs.append((nodes[m - 1], nodes[0]))
        return pairs
    return []


def needs_partner(
    node: int, nodes: Sequence[int], history: Sequence[PairResult], th: Thresholds
) -> bool:
    """Whether the evidence about `node` is not yet enough to judge it."""
    members = set(nodes)
    grading = grade_pairs(history, members, th)
    mine = grading.pairs_of(node)
    partners = {p.other(node) for p in mine}
    required = required_partners(len(members))
    if len(partners) < required:
        return True
    if grading.good(node):
        return False
    vouched = {
        p.other(node)
        for p in mine
        if grading.grades[p] is not Grade.GOOD and grading.good(p.other(node))
    }
    return len(vouched) < required


def plan_round(
    nodes: Sequence[int],
    history: Sequence[PairResult],
    round_index: int,
    th: Thresholds,
    max_rounds: int,
) -> list[Pair]:
    """The pairs of round `round_index` (1-based); empty when the check is done."""
    if round_index > max_rounds or len(nodes) < 2:
        return []
    nodes = sorted(nodes)
    tested = {frozenset((p.a, p.b)) for p in history}
    pairs = [p for p in base_pairs(nodes, round_index) if frozenset(p) not in tested]
    busy = {n for p in pairs for n in p}
    members = set(nodes)
    grading = grade_pairs(history, members, th)
    needy = [n for n in nodes if n not in busy and needs_partner(n, nodes, history, th)]
    for node in needy:
        if node in busy:
            continue
        free = [
            y for y in nodes if y != node and y not in busy and frozenset((node, y)) not in tested
        ]
        if not free:
            continue
        # Prefer a partner that already passed with someone: it vouches for the link's other end.
        free.sort(key=lambda y: (not grading.good(y), y not in needy, y))
        partner = free[0]
        pairs.append((node, partner))
        busy.update((node, partner))
    return pairs
