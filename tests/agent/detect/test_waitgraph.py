"""Table-driven tests of the wait-for graph and deadlock naming (pure): who waits for whom across
groups and p2p peers, which waits form a cycle, and which rank on a cycle is named."""

from __future__ import annotations

import pytest

from diag.agent.detect.culprit import SuspectKind, find_suspects
from diag.agent.detect.deadlock import find_deadlocks
from diag.agent.detect.hang import Policy, VerdictKind, WatchState, decide
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.detect.timeouts import TimeoutPolicy
from diag.agent.detect.waitgraph import Blocked, blocked_ranks, cycles, path, waiting_behind
from diag.formats.records import OpCode, OpState

NOW = 1000.0
S, R = OpCode.SEND, OpCode.RECV
AR = OpCode.ALL_REDUCE


def coll(group: str, seq: int, state: OpState = OpState.ENQUEUED) -> OpView:
    end = None if state.pending else NOW - 10.5
    return OpView(group, seq, AR, state, 1024, NOW - 10 if state.pending else NOW - 11, end)


def p2p(code: OpCode, peer: int, seq: int, pending: bool = False, group: str = "0") -> OpView:
    state = OpState.ENQUEUED if pending else OpState.COMPLETED
    t = NOW - 10 if pending else NOW - 20 + seq * 0.1
    return OpView(group, seq, code, state, 1024, t, None if pending else t + 0.01, peer)


def snap(
    rank: int,
    *,
    pending: tuple[OpView, ...] = (),
    last: dict[str, int] | None = None,
    p2p_ops: tuple[OpView, ...] = (),
    liveness: Liveness = Liveness.RUNNING,
) -> RankSnapshot:
    """`last`: newest collective seq per group besides the pending ones; `p2p_ops`: the p2p
    history (the pending p2p op is added to it)."""
    last_ops = {g: coll(g, s, OpState.COMPLETED) for g, s in (last or {}).items()}
    for op in pending:
        if not op.is_p2p and (
            op.group not in last_ops or last_ops[op.group].group_seq < op.group_seq
        ):
            last_ops[op.group] = op
    hist: dict[tuple[str, int], list[OpView]] = {}
    for op in (*p2p_ops, *(o for o in pending if o.is_p2p)):
        hist.setdefault((op.group, op.peer), []).append(op)
    return RankSnapshot(
        rank=rank, local_rank=rank, pid=100 + rank, node="n", liveness=liveness,
        started_at=0.0, last_activity=NOW - 10, step=10, pending=pending, last_ops=last_ops,
        p2p={k: tuple(v) for k, v in hist.items()}, step_durations=(0.5,),
        exited_at=NOW - 5 if liveness == Liveness.DIED else None,
    )  # fmt: skip


def obs(*ranks: RankSnapshot, groups: dict[str, tuple[int, ...]] | None = None) -> Observation:
    world = max(r.rank for r in ranks) + 1
    return Observation(
        now=NOW, ranks=ranks, groups=groups or {"0": tuple(range(world))}, world_size=world
    )


def exchange_history(rank: int, peer: int, send_first: bool, pairs: int) -> tuple[OpView, ...]:
    """`pairs` completed exchanges with `peer`: send then recv, or recv then send."""
    order = (S, R) if send_first else (R, S)
    return tuple(p2p(order[i % 2], peer, i + 1) for i in range(2 * pairs))


# -- the scenario: two groups with the same members ---------------------------------


def two_group_deadlock() -> Observation:
    groups = {"0": (0, 1, 2, 3), "1": (0, 1, 2, 3)}
    majority = [snap(r, pending=(coll("0", 21),)) for r in (0, 2, 3)]
    odd = snap(1, pending=(coll("1", 1),), last={"0": 20})
    return obs(majority[0], odd, *majority[1:], groups=groups)


def test_graph_of_the_two_group_deadlock() -> None:
    g = blocked_ranks(two_group_deadlock())
    assert {r: b.on for r, b in g.items()} == {0: (1,), 1: (0, 2, 3), 2: (1,), 3: (1,)}
    assert cycles(g) == [(0, 1, 2, 3)]


def test_two_group_deadlock_names_the_rank_that_took_the_other_group_first() -> None:
    o = two_group_deadlock()
    suspects = find_suspects(o)
    assert [(s.rank, s.kind) for s in suspects] == [(1, SuspectKind.DEADLOCK)]
    reason = suspects[0].reason
    assert "all_reduce #1 of group 1" in reason and "all_reduce #21 of group 0" in reason
    assert "last op on group 0 was #20" in reason and "ranks 0,2,3" in reason
    v = decide(WatchState(), o, Policy(timeouts=TimeoutPolicy(floor=2.0))).verdict
    assert v is not None and v.kind == VerdictKind.HANG and v.culprit == 1
    assert "network" not in v.summary and "deadlock across groups" in v.summary


def test_majority_counts_ranks_outside_the_cycle() -> None:
    # Group "1" holds ranks 0 and 1 only: the cycle is 0-1, but ranks 2..7 wait in group 0's
    # #21 with rank 0, so rank 1 is the odd one, and ranks 2..7 wait on the cycle.
    groups = {"0": tuple(range(8)), "1": (0, 1)}
    ranks = [snap(r, pending=(coll("0", 21),), last={"1": 4}) for r in (0, *range(2, 8))]
    ranks.append(snap(1, pending=(coll("1", 5),), last={"0": 20}))
    o = obs(*ranks, groups=groups)
    (d,) = find_deadlocks(o, blocked_ranks(o))
    assert d.ranks == (0, 1) and d.culprits == (1,) and d.behind == tuple(range(2, 8))
    assert "ranks 2,3,4,5,6,7 wait on them" in d.reasons[1]


def test_two_ranks_in_each_others_group_first_are_both_named() -> None:
    groups = {"0": (0, 1), "1": (0, 1)}
    o = obs(
        snap(0, pending=(coll("0", 5),), last={"1": 2}),
        snap(1, pending=(coll("1", 3),), last={"0": 4}),
        groups=groups,
    )
    (d,) = find_deadlocks(o, blocked_ranks(o))
    assert d.culprits == (0, 1) and "no rank on the cycle stands out" in d.reasons[0]


# -- who waits for whom -------------------------------------------------------------------


@pytest.mark.parametrize(
    "waiter, other, edge",
    [
        # A member that issued the collective is inside it or past it (async ops in flight).
        (
            snap(0, pending=(coll("0", 5), coll("1", 2))),
            snap(1, pending=(coll("1", 2), coll("0", 5))),
            False,
        ),
        (snap(0, pending=(coll("0", 5),)), snap(1, last={"0": 6}), False),
        (snap(0, pending=(coll("0", 5),)), snap(1, pending=(coll("1", 9),), last={"0": 4}), True),
        # p2p #K: the peer's matching op answers it; the same op does not.
        (snap(0, pending=(p2p(R, 1, 7, True),)), snap(1, pending=(p2p(S, 0, 7, True),)), False),
        (snap(0, pending=(p2p(R, 1, 7, True),)), snap(1, pending=(p2p(R, 0, 7, True),)), True),
        (snap(0, pending=(p2p(S, 1, 7, True),)), snap(1, pending=(p2p(S, 0, 7, True),)), True),
        (snap(0, pending=(p2p(S, 1, 7, True),)), snap(1, p2p_ops=(p2p(R, 0, 7),)), False),
        # ... a peer past #K (its send completed, buffered) is no blocker; one short of it is.
        (snap(0, pending=(p2p(R, 1, 7, True),)), snap(1, p2p_ops=(p2p(S, 0, 8),)), False),
        (snap(0, pending=(p2p(R, 1, 7, True),)), snap(1, p2p_ops=(p2p(R, 0, 6),)), True),
        (snap(0, pending=(p2p(R, 1, 7, True),)), snap(1), True),
    ],
)
def test_who_waits_for_whom(waiter: RankSnapshot, other: RankSnapshot, edge: bool) -> None:
    g = blocked_ranks(obs(waiter, other, groups={"0": (0, 1), "1": (0, 1)}))
    assert (g[0].on == (1,)) is edge


def test_dead_and_unseen_members_are_no_edges() -> None:
    o = obs(
        snap(0, pending=(coll("0", 5),)),
        snap(1, liveness=Liveness.DIED),
        groups={"0": (0, 1, 2)},
    )
    b = blocked_ranks(o)[0]
    assert b.on == () and b.missing == (2,)


def test_cycles_and_paths_on_a_larger_graph() -> None:
    # 0 -> 1 -> 2 -> 0 is a cycle, 3 -> 4 -> 3 another, 5 waits on the first, 6 waits on 5,
    # 7 waits for rank 9 that waits in nothing.
    edges = {0: (1,), 1: (2,), 2: (0,), 3: (4,), 4: (3,), 5: (0,), 6: (5,), 7: (9,)}
    o = obs(
        *(snap(r, pending=(coll("0", 5),)) for r in edges),
        snap(8),
        snap(9, last={"0": 4}),
    )
    g = {r: Blocked(r, b.op, edges[r]) for r, b in blocked_ranks(o).items()}
    assert cycles(g) == [(0, 1, 2), (3, 4)]
    assert path(g, 1, (0, 1, 2)) == [1, 2, 0]
    assert waiting_behind(g, (0, 1, 2)) == (5, 6)


def test_a_ring_of_thousands_of_ranks_is_one_cycle() -> None:
    n = 3000
    o = obs(*(snap(r, pending=(p2p(R, (r - 1) % n, 1, True),)) for r in range(n)))
    g = blocked_ranks(o)
    assert cycles(g) == [tuple(range(n))]


# -- p2p cycles and pipelines -------------------------------------------------------------


def test_every_rank_receiving_first_in_a_ring_names_them_all() -> None:
    # Ring 0 -> 1 -> 2 -> 3 -> 0; each rank receives from its left before sending right.
    o = obs(*(snap(r, pending=(p2p(R, (r - 1) % 4, 5, True),)) for r in range(4)))
    suspects = find_suspects(o)
    assert [s.rank for s in suspects] == [0, 1, 2, 3]
    assert all(s.kind == SuspectKind.DEADLOCK for s in suspects)
    reason = suspects[0].reason
    assert "rank 0 waits in recv #5 of group 0 from rank 3" in reason
    assert "rank 1 waits in recv #5 of group 0 from rank 0" in reason
    assert "no rank on the cycle stands out" in reason
    v = decide(WatchState(), o, Policy(timeouts=TimeoutPolicy(floor=2.0))).verdict
    assert v is not None and v.culprit is None
    assert v.summary.startswith("hang: no single culprit: deadlock (wait-for cycle): rank 0 waits")


def test_partners_that_both_receive_name_the_one_that_changed_its_order() -> None:
    # Rank 0 always sent first, rank 1 received first; at #9 rank 0 receives first too.
    o = obs(
        snap(
            0,
            pending=(p2p(R, 1, 9, True),),
            p2p_ops=exchange_history(0, 1, True, 4),
            last={"0": 11},
        ),
        snap(
            1,
            pending=(p2p(R, 0, 9, True),),
            p2p_ops=exchange_history(1, 0, False, 4),
            last={"0": 11},
        ),
        snap(2, pending=(coll("0", 12),)),
        snap(3, pending=(coll("0", 12),)),
    )
    suspects = find_suspects(o)
    assert [(s.rank, s.kind) for s in suspects] == [(0, SuspectKind.DEADLOCK)]
    reason = suspects[0].reason
    assert "both receive, neither sends" in reason
    assert "send, recv, send, recv" in reason and "should have been a send" in reason
    assert "ranks 2,3 wait on them" in reason


def test_pipeline_stages_waiting_on_each_other() -> None:
    # 4 stages. Stage 1 waits for its gradient from stage 2 before sending the activation on;
    # stage 2 waits for that activation. Stage 0 waits for its gradient from stage 1, stage 3
    # for its activation from stage 2.
    def hist(rank: int, peer: int, first: OpCode) -> tuple[OpView, ...]:
        other = R if first == S else S
        return tuple(p2p(first if i % 2 == 0 else other, peer, i + 1) for i in range(6))

    stages = [
        snap(0, pending=(p2p(R, 1, 8, True),), p2p_ops=(*hist(0, 1, S), p2p(S, 1, 7))),
        snap(
            1, pending=(p2p(R, 2, 7, True),), p2p_ops=(*hist(1, 0, R), p2p(R, 0, 7), *hist(1, 2, S))
        ),
        snap(2, pending=(p2p(R, 1, 7, True),), p2p_ops=(*hist(2, 1, R), *hist(2, 3, S))),
        snap(3, pending=(p2p(R, 2, 7, True),), p2p_ops=hist(3, 2, R)),
    ]
    o = obs(*stages)
    g = blocked_ranks(o)
    assert {r: b.on for r, b in g.items()} == {0: (1,), 1: (2,), 2: (1,), 3: (2,)}
    (d,) = find_deadlocks(o, g)
    assert d.ranks == (1, 2) and d.culprits == (1,) and d.behind == (0, 3)
    suspects = find_suspects(o)
    assert suspects[0].rank == 1 and suspects[0].kind == SuspectKind.DEADLOCK
    assert "recv #7 of group 0 from rank 2" in suspects[0].reason
    assert "recv #7 of group 0 from rank 1" in suspects[0].reason


def test_a_chain_into_an_idle_rank_is_no_deadlock() -> None:
    groups = {"0": (0, 1), "1": (1, 2)}
    o = obs(
        snap(0, pending=(coll("0", 5),)),
        snap(1, pending=(coll("1", 3),), last={"0": 4}),
        snap(2, last={"1": 2}),
        groups=groups,
    )
    assert cycles(blocked_ranks(o)) == []
    assert [(s.rank, s.kind) for s in find_suspects(o)] == [(2, SuspectKind.BEHIND_IDLE)]


def test_an_idle_p2p_peer_is_behind_with_its_last_exchange() -> None:
    o = obs(
        snap(0, pending=(p2p(R, 1, 9, True),), p2p_ops=exchange_history(0, 1, True, 4)),
        snap(1, p2p_ops=exchange_history(1, 0, False, 4), last={"0": 3}),
        snap(2, last={"0": 3}),
    )
    suspects = find_suspects(o)
    assert [(s.rank, s.kind) for s in suspects] == [(1, SuspectKind.BEHIND_IDLE)]
    assert "recv #9 of group 0 between ranks 0 and 1" in suspects[0].reason
    assert "its last op with rank 0 was send #8" in suspects[0].reason
