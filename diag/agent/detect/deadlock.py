"""Naming the rank behind a deadlock: a cycle of the wait-for graph (waitgraph.py). Pure.

Everyone on a cycle waits, so "who arrived last" means nothing there. What tells the culprit:
- the order of ops: ranks that run the same program wait in the same op. When most ranks on the
  cycle (counting every rank in that op) wait in one op and a few wait in another, the few issue
  their ops in another order than the rest (rank 1 took group 1's all-reduce before group 0's):
  they are named;
- a rank's own order with a p2p peer: two ranks that both receive (or both send) #K from each
  other are symmetric, but the one whose recent ops with that peer repeat a pattern that called
  for the other direction at #K changed its order (it used to send first): it is named;
- otherwise every rank on the cycle is, with the cycle spelled out (every rank receives before it
  sends, say: the program is wrong everywhere).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from diag.agent.detect.observation import Observation, OpView, RankSnapshot
from diag.agent.detect.waitgraph import Blocked, cycles, path, waiting_behind
from diag.formats.records import OpCode

NO_ONE_STANDS_OUT = "no rank on the cycle stands out"
_PERIODS = (1, 2, 3, 4)  # p2p orders repeat within a few ops per peer (send/recv, 1F1B, ...)


@dataclass(frozen=True)
class Deadlock:
    ranks: tuple[int, ...]  # the ranks on the cycle
    culprits: tuple[int, ...]  # whose order differs, else all of `ranks`
    reasons: Mapping[int, str]  # per culprit, for a person
    behind: tuple[int, ...]  # ranks outside the cycle that wait on it


def ranks_text(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {','.join(map(str, rs))}"


def _verb(ranks: Iterable[int], one: str, many: str) -> str:
    return one if len(list(ranks)) == 1 else many


def find_deadlocks(obs: Observation, graph: Mapping[int, Blocked]) -> list[Deadlock]:
    found = cycles(graph)
    if not found:
        return []  # the common case, 128,000 ranks waiting in one collective: no more passes
    by_rank = {r.rank: r for r in obs.all_ranks}
    in_key: dict[tuple[str | int, ...], list[int]] = {}
    for b in graph.values():
        in_key.setdefault(b.key, []).append(b.rank)
    out = []
    for ranks in found:
        keys: dict[tuple[str | int, ...], list[int]] = {}
        for r in ranks:
            keys.setdefault(graph[r].key, []).append(r)
        behind = waiting_behind(graph, ranks)
        tail = f"; {ranks_text(behind)} {_verb(behind, 'waits', 'wait')} on them" if behind else ""
        # The op most ranks wait in, counting those outside the cycle too.
        sizes = sorted(((len(in_key[k]), k) for k in keys), reverse=True)
        unique = len(sizes) > 1 and sizes[0][0] > sizes[1][0]
        if unique:
            major = sizes[0][1]
            culprits = tuple(r for r in ranks if graph[r].key != major)
            reasons = {
                c: _order_reason(c, graph, keys, major, in_key[major], by_rank) + tail
                for c in culprits
            }
        else:
            broke = [r for r in ranks if _breaks_own_order(by_rank.get(r), graph[r].op)]
            if broke and len(broke) < len(ranks):
                culprits = tuple(broke)
                reasons = {
                    c: _cycle_text(c, graph, ranks) + ". " + _order_change(c, graph[c].op, by_rank)
                    + tail
                    for c in culprits
                }  # fmt: skip
            else:
                culprits = ranks
                text = _cycle_text(ranks[0], graph, ranks)
                reasons = {
                    c: f"{text}; {NO_ONE_STANDS_OUT} ({len(ranks)} ranks on it){tail}"
                    for c in culprits
                }
        out.append(Deadlock(ranks, culprits, reasons, behind))
    return out


def _order_reason(
    c: int,
    graph: Mapping[int, Blocked],
    keys: Mapping[tuple[str | int, ...], list[int]],
    major: tuple[str | int, ...],
    majority: list[int],
    by_rank: Mapping[int, RankSnapshot],
) -> str:
    mine = graph[c].key
    if len(keys) != 2:
        return (
            f"{_cycle_text(c, graph, keys[mine])}. {ranks_text(keys[mine]).capitalize()} "
            f"{_verb(keys[mine], 'issues', 'issue')} ops in another order than "
            f"{ranks_text(majority)}"
        )
    few, many = keys[mine], keys[major]
    op_few, op_many = graph[few[0]].op, graph[many[0]].op
    on_few = sorted({m for r in few for m in graph[r].on})
    on_many = sorted({m for r in many for m in graph[r].on})
    where = "across groups" if op_few.group != op_many.group else "in group " + op_few.group
    kind = "" if op_few.is_p2p or op_many.is_p2p else (f" {where}")
    last = ""
    me = by_rank.get(c)
    if me is not None and not op_many.is_p2p:
        prev = me.last_ops.get(op_many.group)
        last = (
            f" (its last op on group {op_many.group} was #{prev.group_seq})"
            if prev is not None
            else f" (it issued nothing on group {op_many.group})"
        )
    return (
        f"deadlock{kind}: {ranks_text(few)} {_verb(few, 'waits', 'wait')} in "
        f"{_op_for(op_few, on_few)}, which {_verb(on_few, 'waits', 'wait')} in "
        f"{_op_for(op_many, on_many)}{last}. {ranks_text(few).capitalize()} "
        f"{_verb(few, 'issues', 'issue')} these ops in another order than {ranks_text(majority)}"
    )


def _op_for(op: OpView, on: Iterable[int]) -> str:
    """`op` and whom it waits for (a p2p op names its peer already)."""
    return op.describe() if op.is_p2p else f"{op.describe()} for {ranks_text(on)}"


def _cycle_text(start: int, graph: Mapping[int, Blocked], ranks: Iterable[int]) -> str:
    """The cycle through `start`, as a person reads it."""
    hops = path(graph, start, ranks)
    a, b = graph[hops[0]], graph[hops[1 % len(hops)]]
    if len(hops) == 2 and a.key == b.key and a.op.op == b.op.op and a.op.is_p2p:
        both = "both receive, neither sends" if a.op.op != OpCode.SEND else "both send"
        return (
            f"deadlock: rank {a.rank} waits in {a.op.describe()} and rank {b.rank} in "
            f"{b.op.describe()}: {both}"
        )
    parts = [
        f"rank {v} waits in {_op_for(graph[v].op, [hops[(i + 1) % len(hops)]])}"
        for i, v in enumerate(hops)
    ]
    return "deadlock (wait-for cycle): " + ", ".join(parts)


def _history(me: RankSnapshot, op: OpView) -> list[OpCode]:
    return [o.op for o in me.p2p.get((op.group, op.peer), ()) if o.group_seq < op.group_seq]


def _expected(hist: list[OpCode]) -> OpCode | None:
    """The next op of a repeating order (send, recv, send, recv -> send), if it repeats twice."""
    for p in _PERIODS:
        if len(hist) >= 2 * p and hist[-p:] == hist[-2 * p : -p]:
            return hist[-p]
    return None


def _breaks_own_order(me: RankSnapshot | None, op: OpView) -> bool:
    if me is None or not op.is_p2p:
        return False
    want = _expected(_history(me, op))
    return want is not None and want != op.op


def _order_change(c: int, op: OpView, by_rank: Mapping[int, RankSnapshot]) -> str:
    hist = _history(by_rank[c], op)
    want = _expected(hist)
    shown = ", ".join(o.label for o in hist[-4:])
    return (
        f"Rank {c} changed its order with rank {op.peer}: its ops with it went {shown}, so "
        f"#{op.group_seq} should have been a {want.label if want else '?'}, and it called "
        f"{op.op.label}"
    )
