"""The handover decision (pure): a holder writes a peer's replica to storage only after its own
ranks were stopped, only for a peer whose agent stayed silent `lost_after` seconds, only when the
replica is newer than storage's step, only the parts storage lacks, and only once."""

from __future__ import annotations

from diag.agent.replica.handover import (
    Handover,
    HeldReplica,
    PeerFacts,
    Reach,
    StorageView,
    Verdict,
    decide_handover,
    look_again,
    next_reach,
    wants_reach,
)

B = HeldReplica("b", 7, "r1", (2, 3))
LOST = Reach(answers=False, since=100.0)


def one(
    facts: PeerFacts,
    *,
    stopped: bool = True,
    now: float = 110.0,
    written: frozenset[tuple[str, int, str]] = frozenset(),
):
    [v] = decide_handover([facts], stopped=stopped, lost_after=5.0, now=now, written=written)
    return v


def test_a_silent_peer_s_newer_replica_is_written_whole():
    v = one(PeerFacts(B, StorageView(latest=4), LOST))
    assert (v.peer, v.step, v.verdict, v.ranks) == ("b", 7, Verdict.PERSIST, (2, 3))


def test_only_the_parts_storage_lacks_are_written():
    v = one(PeerFacts(B, StorageView(latest=4, done=frozenset({3})), LOST))
    assert (v.verdict, v.ranks) == (Verdict.PERSIST, (2,))
    v = one(PeerFacts(B, StorageView(latest=4, done=frozenset({2, 3})), LOST))
    assert v.verdict == Verdict.ON_STORAGE


def test_storage_at_that_step_or_newer_needs_nothing():
    for latest in (7, 9):
        assert one(PeerFacts(B, StorageView(latest), LOST)).verdict == Verdict.ON_STORAGE


def test_a_peer_that_answers_persists_its_own():
    v = one(PeerFacts(B, StorageView(None), Reach(answers=True, since=0.0)))
    assert v.verdict == Verdict.ALIVE and v.ranks == ()


def test_silent_for_less_than_lost_after_waits_and_unprobed_waits():
    assert one(PeerFacts(B, StorageView(None), LOST), now=104.9).verdict == Verdict.WAIT
    assert one(PeerFacts(B, StorageView(None), LOST), now=105.0).verdict == Verdict.PERSIST
    assert one(PeerFacts(B, StorageView(None), None)).verdict == Verdict.WAIT


def test_nothing_while_this_node_s_ranks_run():
    v = one(PeerFacts(B, StorageView(None), LOST), stopped=False)
    assert v.verdict == Verdict.NO_INCIDENT


def test_a_replica_written_before_is_not_written_again_a_newer_one_is():
    done = frozenset({("b", 7, "r1")})
    assert one(PeerFacts(B, StorageView(None), LOST), written=done).verdict == Verdict.DONE
    newer = HeldReplica("b", 8, "r1", (2, 3))
    assert one(PeerFacts(newer, StorageView(7), LOST), written=done).verdict == Verdict.PERSIST


def test_one_verdict_per_peer_in_order():
    c = HeldReplica("c", 7, "r1", (4,))
    out = decide_handover(
        [PeerFacts(B, StorageView(None), LOST), PeerFacts(c, StorageView(None), Reach(True, 0))],
        stopped=True, lost_after=5.0, now=110.0,
    )  # fmt: skip
    assert [(v.peer, v.verdict) for v in out] == [("b", Verdict.PERSIST), ("c", Verdict.ALIVE)]


def test_silence_is_timed_from_the_first_probe_that_saw_it():
    r = next_reach(None, False, 10.0)
    assert r == Reach(False, 10.0)
    assert next_reach(r, False, 12.0) is r
    assert next_reach(r, True, 13.0) == Reach(True, 13.0)
    assert next_reach(Reach(True, 13.0), False, 14.0) == Reach(False, 14.0)


def test_a_peer_is_asked_only_for_a_replica_storage_lacks():
    assert wants_reach(B, StorageView(4), frozenset())
    assert not wants_reach(B, StorageView(7), frozenset())
    assert not wants_reach(B, StorageView(4, frozenset({2, 3})), frozenset())
    assert not wants_reach(B, StorageView(4), frozenset({("b", 7, "r1")}))


def test_looked_at_again_while_a_peer_is_silent_too_briefly_or_answers():
    def h(verdict: Verdict) -> Handover:
        return Handover("b", 7, verdict, "")

    assert look_again([h(Verdict.ON_STORAGE), h(Verdict.WAIT)])
    assert look_again([h(Verdict.ALIVE)])
    assert not look_again([h(v) for v in Verdict if v not in (Verdict.WAIT, Verdict.ALIVE)])
