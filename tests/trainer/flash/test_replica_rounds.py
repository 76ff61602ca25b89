"""Replication rounds (trainer.flash.replicarounds), pure: whatever the pace of the pushes against
the steps, every step a holder may hold for a node is one every rank keeps; and a resume from
storage while steps were in memory says which steps each rank held."""

from __future__ import annotations

import random

import pytest

from diag.trainer.flash.replicarounds import Agreed, Rounds, advance, resumed, vote
from diag.trainer.flash.resume import RankFacts, ResumePlan, Source, fell_back, held_text

RUN = "n0:1:2.000"


def _agree(rounds: Rounds, confirmed: list[tuple[int, str] | None], holds: bool = True) -> Agreed:
    votes = [
        vote(rounds, replicating=True, confirmed=c, run=RUN, holds_current=holds) for c in confirmed
    ]
    return Agreed(
        all(v.ready for v in votes),
        any(v.replicating for v in votes),
        any(v.abandon for v in votes),
    )


def test_the_first_save_starts_a_round_and_a_confirmed_round_becomes_the_kept_step() -> None:
    r0 = Rounds()
    r1, is_round = advance(r0, 10, _agree(r0, [None, None]))
    assert is_round and r1 == Rounds(current=10, kept=None)
    # One node's holders have not taken step 10 yet: step 11 is not a round step.
    r2, is_round = advance(r1, 11, _agree(r1, [(10, RUN), None]))
    assert not is_round and r2 == r1
    # Both took it: step 12 starts the next round, 10 is kept until 12 is confirmed.
    r3, is_round = advance(r2, 12, _agree(r2, [(10, RUN), (10, RUN)]))
    assert is_round and r3 == Rounds(current=12, kept=10) and r3.keep() == {10, 12}


def test_a_confirmation_of_another_launch_does_not_count() -> None:
    r = Rounds(current=5)
    v = vote(r, replicating=True, confirmed=(5, "other:1:1.000"), run=RUN, holds_current=True)
    assert not v.ready and not v.abandon


def test_without_replication_there_are_no_rounds() -> None:
    r, is_round = advance(Rounds(current=3, kept=1), 4, Agreed(True, False, False))
    assert not is_round and r == Rounds() and r.keep() == frozenset()


def test_a_rank_that_lost_the_round_step_abandons_the_round_and_the_kept_step_stays() -> None:
    r = Rounds(current=8, kept=6)
    agreed = _agree(r, [None, (6, RUN)], holds=False)
    assert agreed.any_abandon and not agreed.all_ready
    after, is_round = advance(r, 9, agreed)
    assert is_round and after == Rounds(current=9, kept=6)


def test_a_launch_resumed_from_memory_keeps_that_step_until_a_round_is_confirmed() -> None:
    assert resumed(47, True) == Rounds(kept=47)
    assert resumed(40, False) == Rounds()
    assert resumed(None, True) == Rounds()


@pytest.mark.parametrize("push_steps", [0.3, 1.0, 1.4, 2.5, 7.0])
def test_every_step_a_holder_may_hold_is_kept_by_every_rank(push_steps: float) -> None:
    """A simulation of two nodes each pushing to the other: a push of a round step takes
    `push_steps` steps (with jitter); the holder keeps its old replica until the new one is whole.
    At every step, what either holder holds is in the ranks' kept set or is their newest step,
    so a node lost at any step shares a step with the survivors no older than its replica."""
    rng = random.Random(int(push_steps * 1000))
    rounds = Rounds()
    held: list[int | None] = [None, None]  # what node i's holder holds of node i
    arrives: list[tuple[float, int] | None] = [None, None]  # a push under way: (at, step)
    confirmed: list[tuple[int, str] | None] = [None, None]
    newest: list[int] = []  # each rank's newest snapshots (two slots of their own)
    behind = []
    for step in range(1, 400):
        now = float(step)
        for i in (0, 1):
            a = arrives[i]
            if a is not None and a[0] <= now:
                held[i] = a[1]
                confirmed[i] = (a[1], RUN)
                arrives[i] = None
        rounds, is_round = advance(rounds, step, _agree(rounds, confirmed))
        newest = [*newest, step][-2:]
        if is_round:
            for i in (0, 1):
                took = push_steps * rng.uniform(0.7, 1.3)
                arrives[i] = (now + max(0.05, took), step)
        kept = set(rounds.keep()) | set(newest)
        for h in held:
            if h is not None:
                assert h in kept, (step, h, rounds, newest)
                behind.append(step - h)
    # The rounds follow the pushes: a replica is never more than a push and a step behind.
    assert max(behind) <= int(push_steps * 1.3) * 2 + 3


def test_a_fallback_to_storage_with_steps_in_memory_names_what_each_rank_held() -> None:
    facts = [
        RankFacts(0, (46, 47), 40),
        RankFacts(1, (45,), 40),
        RankFacts(2, (46, 47), 40),
    ]
    plan = ResumePlan(Source.STORAGE, 40, "no step in memory on every rank")
    assert fell_back(plan, facts)
    assert held_text(facts) == "ranks 0,2: 46, 47; rank 1: 45"
    assert not fell_back(ResumePlan(Source.MEMORY, 47, "newest common"), facts)
    assert not fell_back(plan, [RankFacts(0, (), 40), RankFacts(1, (), 40)])
    many = [RankFacts(r, (1, 2, 3, 4, 5, 6), None) for r in range(4)]
    assert held_text(many) == "ranks 0-3: ..., 3, 4, 5, 6"
