"""The peer board: what one agent publishes, another reads on its own clock, and the culprit
analysis that then names a rank on another node."""

from __future__ import annotations

import json
from pathlib import Path

from diag.agent.board import Board, board_document, snapshots_from
from diag.agent.culprit import SuspectKind, find_suspects
from diag.agent.hang import Policy, WatchState, decide
from diag.agent.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.timeouts import TimeoutPolicy
from diag.collector.records import OpCode, OpState


def _rank(r: int, node: str, now: float, *, pending: bool, last: float) -> RankSnapshot:
    done = OpView("0", 41, OpCode.ALL_REDUCE, OpState.COMPLETED, 64, now - 12, now - 11.9)
    stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, now - 10)
    return RankSnapshot(
        rank=r, local_rank=r % 2, pid=100 + r, node=node, liveness=Liveness.RUNNING,
        started_at=0.0, last_activity=now - last, step=7, pending=(stuck,) if pending else (),
        last_ops={"0": stuck if pending else done}, step_durations=(0.5,), cpu_busy=0.0,
    )  # fmt: skip


def _obs(node: str, now: float, ranks: tuple[RankSnapshot, ...]) -> Observation:
    return Observation(now=now, ranks=ranks, groups={"0": (0, 1, 2, 3)}, world_size=4, job="j")


def test_round_trip_moves_times_to_the_readers_clock() -> None:
    b_now = 5000.0
    b = _obs(
        "node-b",
        b_now,
        (
            _rank(2, "node-b", b_now, pending=True, last=10),
            _rank(3, "node-b", b_now, pending=False, last=11.9),
        ),
    )
    doc = json.loads(json.dumps(board_document(b, "node-b", wall=1_000_000.0)))
    # The reader's monotonic clock is elsewhere, and it reads 1.5 s after the writing.
    a_now = 70.0
    snaps = snapshots_from(doc, a_now, wall=1_000_001.5)
    r2, r3 = snaps
    assert (r2.rank, r2.node, r3.rank) == (2, "node-b", 3)
    assert abs(r2.pending[0].t_enqueue - (a_now - 1.5 - 10)) < 1e-6
    assert abs(r3.last_activity - (a_now - 1.5 - 11.9)) < 1e-6
    assert r3.last_ops["0"].group_seq == 41 and r3.last_ops["0"].state == OpState.COMPLETED


def test_a_rank_on_another_node_is_named_with_its_node(tmp_path: Path) -> None:
    now = 100.0
    a = _obs(
        "node-a",
        now,
        (
            _rank(0, "node-a", now, pending=True, last=10),
            _rank(1, "node-a", now, pending=True, last=10),
        ),
    )
    alone = find_suspects(a)
    assert {(s.rank, s.kind) for s in alone} == {(2, SuspectKind.REMOTE), (3, SuspectKind.REMOTE)}
    b = _obs(
        "node-b",
        now,
        (
            _rank(2, "node-b", now, pending=True, last=10),
            _rank(3, "node-b", now, pending=False, last=11.9),
        ),
    )
    Board(tmp_path, "node-b").publish(b, force=True)
    remote, groups = Board(tmp_path, "node-a").peers(a)
    assert sorted(r.rank for r in remote) == [2, 3] and groups == {"0": (0, 1, 2, 3)}
    seen = Observation(
        now=now, ranks=a.ranks, groups=a.groups, world_size=4, job="j", remote=tuple(remote)
    )
    verdict = decide(WatchState(), seen, Policy(timeouts=TimeoutPolicy(floor=2.0))).verdict
    assert verdict is not None and verdict.culprit == 3
    assert "rank 3 on node node-b never joined" in verdict.suspects[0].reason
    assert [s.rank for s in verdict.suspects] == [3]  # rank 2 waits like the others


def test_stale_or_foreign_entries_are_left_out(tmp_path: Path) -> None:
    now = 100.0
    b = _obs("node-b", now, (_rank(3, "node-b", now, pending=False, last=11.9),))
    Board(tmp_path, "node-b").publish(b, force=True)
    a = _obs("node-a", now, (_rank(0, "node-a", now, pending=True, last=10),))
    reader = Board(tmp_path, "node-a")
    assert reader.peers(a)[0]
    assert reader.peers(a, since=now + 5)[0] == []  # written before the wait began
    other_attempt = Observation(
        now=now, ranks=a.ranks, groups=a.groups, world_size=4, job="j", attempt=1
    )
    assert reader.peers(other_attempt)[0] == []
    (tmp_path / "j" / "broken.json").write_text("{not json")
    assert [r.rank for r in reader.peers(a)[0]] == [3]
