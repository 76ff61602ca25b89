"""Which job incident a node's incident belongs to, and whether the node files a report: the
pure rules, table-driven, times as plain numbers."""

from __future__ import annotations

import pytest

from diag.agent.job.assembly import pick_culprit, ready
from diag.agent.job.decisions import (
    Claim,
    Filing,
    Known,
    Mine,
    NodeReport,
    Where,
    choose,
    filing,
    generation,
    parse_name,
)

L, R = Where.LOCAL, Where.REMOTE
SINCE = 1000.0  # the node's ranks attached then


def _mine(incident_id: str, where: Where, at: float = 1100.0, first: float | None = None) -> Mine:
    return Mine(incident_id, where, first if first is not None else at, at, SINCE)


def _known(incident_id: str, at: float, where: Where | None = L, rank: int | None = 1) -> Known:
    claim = None if where is None else Claim("node-a", where, rank, at)
    return Known(incident_id, at, claim)


HANG = "a0-hang-pg0-seq42"


@pytest.mark.parametrize(
    ("mine", "known", "expected"),
    [
        # Nobody filed yet: our own id; a waiting node waits, a first-hand one files.
        (_mine(HANG, R), [], (HANG, False, False, Filing.WAIT)),
        (_mine(HANG, L), [], (HANG, False, False, Filing.NOW)),
        # The culprit's node filed first-hand under our id: the waiting node files nothing.
        (_mine(HANG, R), [_known(HANG, 1099.5)], (HANG, False, True, Filing.NONE)),
        # A rank died on another node in this attempt: our hang is its consequence, whichever
        # node we are, and its incident is ours.
        (_mine(HANG, R), [_known("a0-rank_exited", 1090.0)],
         ("a0-rank_exited", True, True, Filing.NONE)),
        (_mine(HANG, L), [_known("a0-rank_exited", 1090.0)],
         ("a0-rank_exited", True, True, Filing.NONE)),
        # ... but not a death of another attempt, nor one of an earlier run of the job.
        (_mine(HANG, R), [_known("a1-rank_exited", 1090.0)], (HANG, False, False, Filing.WAIT)),
        (_mine(HANG, R), [_known("a0-rank_exited", 900.0)], (HANG, False, False, Filing.WAIT)),
        # Deaths share one id per attempt: a death after the one claimed is a consequence ...
        (_mine("a0-rank_exited", L, first=1095.0), [_known("a0-rank_exited", 1090.0)],
         ("a0-rank_exited", False, True, Filing.NONE)),
        # ... an earlier one (its agent was slower to see it) is filed, and leads.
        (_mine("a0-rank_exited", L, first=1089.0), [_known("a0-rank_exited", 1090.0)],
         ("a0-rank_exited", False, False, Filing.NOW)),
        # An earlier run claimed our id (pods restarted, attempts count from 0 again): the
        # next generation, not that run's verdict.
        (_mine(HANG, L), [_known(HANG, 500.0)], (f"{HANG}~2", False, False, Filing.NOW)),
        (_mine(HANG, R), [_known(HANG, 500.0), _known(f"{HANG}~2", 1099.0)],
         (f"{HANG}~2", False, True, Filing.NONE)),
        # A world formed again in place (a spare took the dead rank's place): the death of the
        # world before explains nothing in the next one, a hang or another death.
        (_mine("a0g1-hang-pg0@1-seq9", L), [_known("a0-rank_exited", 1090.0)],
         ("a0g1-hang-pg0@1-seq9", False, False, Filing.NOW)),
        (_mine("a0g1-rank_exited", L, first=1095.0), [_known("a0-rank_exited", 1090.0)],
         ("a0g1-rank_exited", False, False, Filing.NOW)),
        # ... while a death in the same world still does.
        (_mine("a0g1-hang-pg0@1-seq9", R), [_known("a0g1-rank_exited", 1090.0)],
         ("a0g1-rank_exited", True, True, Filing.NONE)),
        # A stall seen in another collective, claimed first-hand a moment before: joined.
        (_mine(HANG, R), [_known("a0-hang-pg3-seq7-p2p4-5", 1095.0)],
         ("a0-hang-pg3-seq7-p2p4-5", True, True, Filing.NONE)),
        # ... not when it was claimed long before (another stall, which recovered).
        (_mine(HANG, R), [_known("a0-hang-pg3-seq7", 1000.0)], (HANG, False, False, Filing.WAIT)),
        # Another id whose nodes are filing views (no first-hand report): joined, and this
        # node will file its view there too.
        (_mine(HANG, R), [_known("a0-hang-pg3-seq7", 1095.0, where=R, rank=None)],
         ("a0-hang-pg3-seq7", True, False, Filing.WAIT)),
    ],
)  # fmt: skip
def test_choose_and_filing(
    mine: Mine, known: list[Known], expected: tuple[str, bool, bool, Filing]
) -> None:
    t = choose(mine, known, window=20.0)
    assert (t.incident_id, t.adopted, t.consequence, filing(mine, t, settled=False)) == expected
    if t.consequence:
        assert "node node-a reported it first" in t.reason


def test_the_fallback_files_only_when_nothing_covers_it() -> None:
    mine = _mine(HANG, R)
    alone = choose(mine, [], window=20.0)
    assert filing(mine, alone, settled=True) == Filing.NOW
    # Another waiting node filed its view first: ours goes with it.
    views = choose(mine, [_known(HANG, 1110.0, where=R, rank=None)], window=20.0)
    assert filing(mine, views, settled=True) == Filing.NOW
    # Their verdict is in place already: too late to matter.
    done = choose(mine, [Known(HANG, 1110.0, Claim("n", R, None, 1110.0), verdict=True)], 20.0)
    assert filing(mine, done, settled=True) == Filing.NONE


def test_generations() -> None:
    assert generation("a0-hang-pg0-seq42") == ("a0-hang-pg0-seq42", 1)
    assert generation("a0-rank_exited~3") == ("a0-rank_exited", 3)


def test_claim_round_trips_and_old_claims_are_tolerated() -> None:
    c = Claim("gpu-7", L, 12, 1700000000.25)
    assert Claim.parse(c.text()) == c
    assert Claim.parse("gpu-7") is None  # an older agent wrote the node name only
    assert Claim.parse(Claim("n", R, None, 1.0).text()) == Claim("n", R, None, 1.0)


def test_of_several_deaths_the_earliest_leads() -> None:
    reports = [
        NodeReport("node-b", 6, L, "/t/b", kind="rank_exited", first_sign_wall=1000.4),
        NodeReport("node-a", 1, L, "/t/a", kind="rank_exited", first_sign_wall=1000.1),
    ]
    names = [parse_name(r.name()) for r in reports]
    assert all(names)
    read = {n.file: r for n, r in zip(names, reports, strict=True)}  # type: ignore[union-attr]
    rank, node, basis = pick_culprit(names, read)  # type: ignore[arg-type]
    assert (rank, node) == (1, "node-a") and "first of 2" in basis
    # Without their times (not read), the count and then the lower rank decide.
    assert pick_culprit(names)[:2] == (1, "node-a")  # type: ignore[arg-type]


def test_a_death_waits_the_cascade_time_for_an_earlier_one() -> None:
    first_hand = [parse_name(NodeReport("a", 1, L, "/t/a").name())]
    assert not ready(first_hand, 100.0, 100.5, 10.0, cascade=1.0)  # type: ignore[arg-type]
    assert ready(first_hand, 100.0, 101.0, 10.0, cascade=1.0)  # type: ignore[arg-type]
    assert ready(first_hand, 100.0, 100.0, 10.0)  # type: ignore[arg-type]
