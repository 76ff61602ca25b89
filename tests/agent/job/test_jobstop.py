"""When a node stops its ranks for an incident another node of the job reported: the pure rule,
table-driven, times as plain numbers."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from diag.agent.detect.hang import (
    ActionKind,
    EventKind,
    OnHang,
    Policy,
    VerdictKind,
    WatchState,
    open_incident,
)
from diag.agent.detect.observation import Liveness, Observation, RankSnapshot
from diag.agent.job.decisions import Claim, Known, NodeReport, Where
from diag.agent.job.jobstop import (
    LOOK_EVERY,
    Follow,
    Local,
    StopState,
    Trigger,
    follow,
    needs_settled,
    verdict_for,
    wants_look,
)
from diag.agent.job.link import JobLink
from diag.agent.job.verdict import JobVerdictStore

L, R = Where.LOCAL, Where.REMOTE
SINCE = 1000.0  # this node's ranks started then (wall clock)
HANG = "a0-hang-pg0-seq42"
DEATH = "a0-rank_exited"


def _local(**kw: object) -> Local:
    base = Local(node="node-a", attempt=0, live_ranks=2, since_wall=SINCE, open_incident=None,
                 stop=True)  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


def _known(
    incident_id: str = HANG,
    at: float = 1100.0,
    where: Where | None = L,
    rank: int | None = 3,
    node: str = "node-b",
    **kw: bool,
) -> Known:
    claim = None if where is None else Claim(node, where, rank, at)
    return Known(incident_id, at, claim, **kw)


@pytest.mark.parametrize(
    ("local", "known", "expected"),
    [
        # Nothing known: nothing to do.
        (_local(), [], (None, None)),
        # The culprit's node claimed a hang first-hand: stop at once, no job verdict awaited.
        (_local(), [_known()], (HANG, Trigger.FIRST_HAND)),
        # A rank died on another node in this attempt.
        (_local(), [_known(DEATH, rank=1)], (DEATH, Trigger.DEATH)),
        # A claim of views only: not until the job verdict is in place, or a first-hand
        # report came under it.
        (_local(), [_known(where=R, rank=None)], (None, None)),
        (_local(), [_known(where=R, rank=None, verdict=True)], (HANG, Trigger.JOB_VERDICT)),
        (_local(), [_known(where=R, rank=None, marked=True)], (HANG, Trigger.FIRST_HAND)),
        # A claim being written (its file not yet readable): the next look.
        (_local(), [_known(where=None)], (None, None)),
        # Not this node's own claim: its own verdict handled its ranks.
        (_local(), [_known(node="node-a")], (None, None)),
        # Not another attempt's incident, nor an earlier run's (claimed long before the ranks
        # started).
        (_local(attempt=1), [_known()], (None, None)),
        (_local(), [_known(at=SINCE - 60)], (None, None)),
        # Without --on-hang stop, without live ranks, or with an incident of its own open:
        # nothing.
        (_local(stop=False), [_known()], (None, None)),
        (_local(live_ranks=0), [_known()], (None, None)),
        (_local(open_incident=HANG), [_known()], (None, None)),
        # Of two, the one claimed first.
        (_local(), [_known("a0-hang-pg0-seq50", at=1101.0), _known(DEATH, at=1100.5)],
         (DEATH, Trigger.DEATH)),
    ],
)  # fmt: skip
def test_which_incident_stops_the_ranks(
    local: Local, known: list[Known], expected: tuple[str | None, Trigger | None]
) -> None:
    f = follow(StopState(), local, known, now=50.0)
    got = (f.incident.incident_id if f.incident else None, f.trigger)
    assert got == expected


def test_once_per_attempt_and_again_after_a_restart() -> None:
    k = _known()
    first = follow(StopState(), _local(), [k], now=50.0)
    assert first.incident == k
    # The ranks are still seen alive while they stop: no second stop in this attempt.
    again = follow(first.state, _local(), [k], now=60.0)
    assert again.incident is None and again.state == first.state
    assert not wants_look(first.state, _local(), 60.0)
    # The ranks restarted (attempt 1): a new incident of that attempt stops them again.
    k1 = _known("a1-hang-pg0-seq7", at=1200.0)
    third = follow(again.state, _local(attempt=1), [k, k1], now=70.0)
    assert (third.incident, third.trigger) == (k1, Trigger.FIRST_HAND)


def test_once_per_world_when_the_world_forms_again_in_place() -> None:
    """Under recovery in place the attempt stays: the next world (a spare in the dead rank's
    place) opens a new era, whose incidents stop the ranks again; the last world's do not."""
    k = _known(DEATH, rank=1)
    first = follow(StopState(), _local(), [k], now=50.0)
    assert first.incident == k
    k1 = _known("a0g1-hang-pg0@1-seq7", at=1200.0)
    again = follow(first.state, _local(world=1), [k, k1], now=60.0)
    assert (again.incident, again.trigger) == (k1, Trigger.FIRST_HAND)
    assert follow(StopState(), _local(world=1), [k], now=50.0).incident is None


def test_an_incident_of_its_own_closes_the_attempt() -> None:
    """The node's own verdict stopped its ranks: a claim by another node of the same attempt
    found later (the ranks still seen alive) stops nothing more."""
    opened = follow(StopState(), _local(open_incident=HANG), [], now=50.0)
    assert opened.state.closed_era == (0, 0)
    after = follow(opened.state, _local(), [_known("a0-hang-pg1-seq3")], now=60.0)
    assert after.incident is None


def test_looks_at_most_every_look_every_seconds() -> None:
    s = follow(StopState(), _local(), [], now=50.0).state
    assert not wants_look(s, _local(), 50.0 + LOOK_EVERY / 2)
    assert wants_look(s, _local(), 50.0 + LOOK_EVERY)
    # A look that is not due finds nothing even with a claim there.
    assert follow(s, _local(), [_known()], now=50.0 + LOOK_EVERY / 2).incident is None


def test_needs_settled_only_where_the_claim_says_too_little() -> None:
    assert not needs_settled(_known())
    assert not needs_settled(_known(DEATH, where=R, rank=None))
    assert needs_settled(_known(where=R, rank=None))
    assert needs_settled(_known(where=None))


def _obs() -> Observation:
    ranks = tuple(
        RankSnapshot(
            rank=r,
            local_rank=r,
            pid=100 + r,
            node="node-a",
            liveness=Liveness.RUNNING,
            started_at=10.0,
            last_activity=40.0,
            step=5,
        )
        for r in (0, 1)
    )
    return Observation(now=50.0, ranks=ranks, groups={}, world_size=4)


def test_the_stop_goes_through_the_actions_of_a_verdict() -> None:
    """Evidence first, then checkpoints, then the live ranks stopped, under the job's incident
    id with no culprit of its own, and the trigger in its summary."""
    f = follow(StopState(), _local(), [_known()], now=50.0)
    v = verdict_for(f, _obs())
    assert v is not None
    assert (v.kind, v.incident_id, v.culprit) == (VerdictKind.HANG, HANG, None)
    assert "rank 3 on node node-b reported it first-hand" in v.summary
    assert "trigger: first-hand" in v.summary
    policy = Policy(on_hang=OnHang.STOP, persist_on_incident=True)
    d = open_incident(WatchState(attempt=0), _obs(), policy, v)
    assert [a.kind for a in d.actions] == [
        ActionKind.CAPTURE_EVIDENCE, ActionKind.PERSIST_CHECKPOINT, ActionKind.STOP_RANKS,
    ]  # fmt: skip
    assert d.actions[-1].ranks == (0, 1)
    assert d.state.incident == v and [e.kind for e in d.events] == [EventKind.INCIDENT]
    assert verdict_for(Follow(StopState()), _obs()) is None


def test_only_the_jobs_own_incidents_are_looked_at(tmp_path: Path) -> None:
    """Through the real file adapter: an incident of another job on the same timeline, or of
    another attempt, is not listed; a claim of views is looked at for its verdict."""
    store = JobVerdictStore(tmp_path / "timeline" / ".jobs")
    link = JobLink(store, "node-a")
    now = time.time()

    def report(node: str, where: Where, rank: int | None) -> NodeReport:
        return NodeReport(node, rank, where, str(tmp_path / "timeline" / f"e-{node}"),
                          wall=now, first_sign_wall=now)  # fmt: skip

    assert store.file("other", HANG, report("node-x", L, 5))
    assert store.file("mn", "a1-hang-pg0-seq9", report("node-b", L, 3))
    assert link.incidents("mn", 0, now - 5) == []
    assert store.file("mn", HANG, report("node-b", R, None))
    (k,) = link.incidents("mn", 0, now - 5)
    assert (k.incident_id, k.verdict, k.marked) == (HANG, False, False)
    local = _local(since_wall=now - 5)
    assert follow(StopState(), local, [k], now=50.0).incident is None
    # A first-hand report under that claim: the marker, found at the next look.
    assert not store.file("mn", HANG, report("node-c", L, 3))
    (k,) = link.incidents("mn", 0, now - 5)
    f = follow(StopState(), local, [k], now=50.0)
    assert (f.incident, f.trigger) == (k, Trigger.FIRST_HAND) and k.marked
