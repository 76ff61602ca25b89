"""Replication rounds (trainer.flash.replicarounds), pure: whatever the pace of the pushes against
the steps, every step a holder may hold for a node is one every rank keeps; and a resume from
storage while steps were in memory says which steps each rank held."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from snapshot_helpers import captured, model_states, write_snapshot

from diag.trainer.control.message import ReplicaAck
from diag.trainer.flash.agreeing import agree_save
from diag.trainer.flash.replicarounds import Agreed, Rounds, advance, resumed, vote
from diag.trainer.flash.replicating import Replication
from diag.trainer.flash.resume import RankFacts, ResumePlan, Source, fell_back, held_text
from diag.trainer.flash.slots import RankSlots, SlotOwner

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
    # Storage newer than every step in memory (a replica behind a persist): no fallback.
    behind = [RankFacts(0, (17, 18), 20), RankFacts(1, (17,), 20)]
    assert not fell_back(ResumePlan(Source.STORAGE, 20, "no step in memory on every rank"), behind)
    assert fell_back(ResumePlan(Source.STORAGE, None, "nothing"), behind)
    # One rank newer than storage, the other's only step older (node a's own steps, node b's
    # replica behind the persist): storage's step is the newest the job has.
    split = [RankFacts(0, (22, 23), 20), RankFacts(1, (12,), 20)]
    assert not fell_back(ResumePlan(Source.STORAGE, 20, "no step in memory on every rank"), split)
    many = [RankFacts(r, (1, 2, 3, 4, 5, 6), None) for r in range(4)]
    assert held_text(many) == "ranks 0-3: ..., 3, 4, 5, 6"


def test_a_rank_keeps_the_round_steps_in_its_slots_while_its_newest_rotate(tmp_path: Path) -> None:
    """The trainer's side over real slots in shared memory (one rank: the all-reduce is its own
    vote): once its agent says it replicates, the rank keeps a third slot; the round step and the
    kept one are never written over, while saves between confirmations take the free slot; the
    agent's confirmation of the round step starts the next round."""
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-rounds-", dir="/dev/shm"))
    slots = RankSlots(run_dir, SlotOwner("j", 0, 1, 0, os.getpid(), 0.0))
    rep = Replication(slots, RUN)
    marked: list[int] = []

    def save(step: int) -> None:
        rep.prepare()
        got = slots.acquire(1 << 20)
        everyone, agreed = agree_save((got is not None, rep.vote()), None, 1)
        assert everyone and got is not None, f"step {step}: no slot free"
        _, slot = got
        if rep.agreed(step, agreed):
            marked.append(step)
        files = captured({f"global_step{step}/f.pt": model_states(step)})
        write_snapshot(slot, step, files, job="j", rank=0, world=1, save_dir=tmp_path,
                       replica_round=step in marked)  # fmt: skip
        slot.unlock()

    try:
        save(1)  # no word from the agent yet: two slots, no rounds
        assert len(slots.paths) == 2 and marked == []
        rep.acknowledged(ReplicaAck(True, -1, ""))
        save(2)
        assert len(slots.paths) == 3 and marked == [2]
        for step in (3, 4, 5, 6):  # the holders have not confirmed 2: no new round
            save(step)
        assert marked == [2] and {2, 6} <= set(slots.complete())
        rep.acknowledged(ReplicaAck(True, 2, RUN))
        save(7)
        assert marked == [2, 7] and rep.rounds == Rounds(current=7, kept=2)
        for step in (8, 9, 10):
            save(step)
        # Whatever the holders hold now (2, or 7 once it arrives) every rank still holds.
        assert {2, 7, 10} == set(slots.complete())
        rep.acknowledged(ReplicaAck(True, 7, RUN))
        save(11)
        assert marked == [2, 7, 11] and {7, 11} <= set(slots.complete())
    finally:
        slots.close(remove=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_rank_whose_agent_has_not_said_it_replicates_still_has_room_for_the_rounds(
    tmp_path: Path,
) -> None:
    """A launch resumed from memory keeps that step; the other node's ranks replicate, so the
    job's saves start rounds this rank keeps too, though its own agent has not said it
    replicates (it registered before its holders were known). With only its two slots both kept,
    every save was skipped on every rank, and the rounds, which move only at a save, never
    freed them: no snapshot until the next fault (seen in the goodput bench after a lost node)."""
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-rounds-", dir="/dev/shm"))
    slots = RankSlots(run_dir, SlotOwner("j", 0, 1, 0, os.getpid(), 0.0))
    rep = Replication(slots, RUN)

    def save(step: int, all_ready: bool) -> None:
        rep.prepare()
        got = slots.acquire(1 << 20)
        assert got is not None, f"step {step}: no slot free (kept {sorted(slots.keep)})"
        _, slot = got
        # The other node's ranks replicate: the all-reduce says so, whatever this rank voted.
        rep.agreed(step, Agreed(all_ready=all_ready, any_replicating=True, any_abandon=False))
        files = captured({f"global_step{step}/f.pt": model_states(step)})
        write_snapshot(slot, step, files, job="j", rank=0, world=1, save_dir=tmp_path)
        slot.unlock()

    try:
        save(21, all_ready=False)  # the step the last launch held, as this launch found it
        rep.resumed(21, from_memory=True)
        save(22, all_ready=True)  # the first save starts a round: 21 and 22 both kept
        assert rep.rounds == Rounds(current=22, kept=21)
        for step in (23, 24, 25):  # the holders have not confirmed 22 yet
            save(step, all_ready=False)
        assert {21, 22, 25} <= set(slots.complete())
    finally:
        slots.close(remove=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_save_with_no_slot_free_says_what_holds_each(tmp_path: Path) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-rounds-", dir="/dev/shm"))
    slots = RankSlots(run_dir, SlotOwner("j", 0, 1, 0, os.getpid(), 0.0))
    try:
        for step in (4, 5):
            got = slots.acquire(1 << 20)
            assert got is not None
            files = captured({f"global_step{step}/f.pt": model_states(step)})
            write_snapshot(got[1], step, files, job="j", rank=0, world=1, save_dir=tmp_path)
            got[1].unlock()
        slots.keep = frozenset({4})
        slots.pin(1, 5)
        assert slots.acquire(1 << 20) is None
        assert slots.refusal == (
            "slot 0: step 4, kept for a replication round; slot 1: step 5, its persist pending"
        ), slots.refusal
    finally:
        slots.close(remove=True)
        shutil.rmtree(run_dir, ignore_errors=True)
