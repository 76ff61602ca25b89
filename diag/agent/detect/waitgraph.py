"""Who waits for whom: the wait-for graph of ranks stuck in collectives and p2p ops. Pure.

A rank waits in its oldest unfinished op. It waits *for* the ranks that op needs and that have
not reached it:
- a collective, #N of group G: every member of G whose newest op on G is older than #N (collectives
  are issued in the same order on every member, so a member that issued #N is inside it or past
  it);
- a point-to-point op, #K between two ranks (sequence numbers count the pair's sends and receives
  alike, so #K of one side is #K of the other): the peer, unless its #K is the matching op (a send
  for a receive) or it is past #K. A peer whose #K is the same op (both receive) never answers.

Every member is needed for the op to finish, so a cycle in this graph is a deadlock: no rank on it
can move before another on it does. Cycles are found as strongly connected components.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from diag.agent.detect.observation import Observation, OpView, RankSnapshot
from diag.formats.records import OpCode

# (group, seq) for a collective; (group, seq, low rank, high rank) for p2p
WaitKey = tuple[str | int, ...]


@dataclass(frozen=True)
class Blocked:
    """One rank stuck in an op, and the ranks in view it waits for."""

    rank: int
    op: OpView
    on: tuple[int, ...]
    missing: tuple[int, ...] = ()  # ranks it needs that the observation does not show

    @property
    def key(self) -> WaitKey:
        return wait_key(self.rank, self.op)


def wait_key(rank: int, op: OpView) -> WaitKey:
    """Identifies the op across the ranks taking part in it."""
    if op.is_p2p:
        return (op.group, op.group_seq, min(rank, op.peer), max(rank, op.peer))
    return (op.group, op.group_seq)


def needed(rank: int, op: OpView, groups: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The other ranks that must take part in `op` for it to finish."""
    if op.is_p2p:
        return (op.peer,) if op.peer >= 0 and op.peer != rank else ()
    return tuple(m for m in groups.get(op.group, ()) if m != rank)


_MATCH = {OpCode.SEND: (OpCode.RECV, OpCode.RECV_ANYSOURCE), OpCode.RECV: (OpCode.SEND,)}


def p2p_counterpart(other: RankSnapshot, rank: int, op: OpView) -> OpView | None:
    """`other`'s op #K with `rank` (the one `op` of `rank` pairs with), if it has issued it."""
    for o in other.pending:
        if o.is_p2p and o.group == op.group and o.peer == rank and o.group_seq == op.group_seq:
            return o
    for o in reversed(other.p2p.get((op.group, rank), ())):
        if o.group_seq == op.group_seq:
            return o
    return None


def arrived(other: RankSnapshot, rank: int, op: OpView) -> bool:
    """Whether `other` has done its part of `rank`'s op `op` (or is inside it)."""
    if not op.is_p2p:
        last = other.last_ops.get(op.group)
        return last is not None and last.group_seq >= op.group_seq
    mine = p2p_counterpart(other, rank, op)
    if mine is not None:
        return mine.op in _MATCH.get(op.op, ())
    hist = other.p2p.get((op.group, rank), ())
    return bool(hist) and hist[-1].group_seq > op.group_seq


def blocked_ranks(obs: Observation) -> dict[int, Blocked]:
    """Every live rank in view (local or published by another node) that waits in an op."""
    by_rank = {r.rank: r for r in obs.all_ranks}
    out: dict[int, Blocked] = {}
    # Whether a member has arrived at a collective does not depend on who asks: one pass per
    # collective, not one per waiting rank (thousands of ranks wait in the same all-reduce).
    # The waiting ranks share its tuples too: with thousands of ranks missing from view (nodes
    # that filed no report), a copy each would be quadratic.
    collective: dict[tuple[str, int], tuple[tuple[int, ...], tuple[int, ...], frozenset[int]]] = {}
    for r in obs.all_ranks:
        if not r.alive or not r.pending:
            continue
        op = r.pending[0]
        if op.is_p2p:
            on, missing = _blockers(r.rank, op, obs, by_rank)
        else:
            key = (op.group, op.group_seq)
            if key not in collective:
                on_all, missing_all = _blockers(-1, op, obs, by_rank)
                collective[key] = (on_all, missing_all, frozenset(on_all + missing_all))
            on, missing, listed = collective[key]
            if r.rank in listed:  # rarely: a rank is in view and inside the op itself
                on = tuple(m for m in on if m != r.rank)
                missing = tuple(m for m in missing if m != r.rank)
        out[r.rank] = Blocked(r.rank, op, on, missing)
    return out


def _blockers(
    rank: int, op: OpView, obs: Observation, by_rank: Mapping[int, RankSnapshot]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ranks in view that have not done their part of `op`, ranks not in view)."""
    on, missing = [], []
    for m in needed(rank, op, obs.groups):
        other = by_rank.get(m)
        if other is None:
            missing.append(m)
        elif other.alive and not arrived(other, rank, op):
            on.append(m)
    return tuple(on), tuple(missing)


def cycles(graph: Mapping[int, Blocked]) -> list[tuple[int, ...]]:
    """Sets of ranks that wait on each other (strongly connected, two ranks or more), each
    sorted, ordered by their lowest rank. Only waiting ranks take part: a rank that waits for
    one outside any op is not on a cycle through it."""
    # Ranks waiting in one collective share their `on` tuple (blocked_ranks): filtered once.
    shared: dict[int, list[int]] = {}
    edges: dict[int, list[int]] = {}
    for v, b in graph.items():
        out = shared.get(id(b.on))
        if out is None:
            out = shared[id(b.on)] = [w for w in b.on if w in graph]
        edges[v] = out
    # A rank that waits for no waiting rank is on no cycle, nor is one that waits only for such
    # ranks: peeled off first (linear), so that 128,000 ranks waiting in one collective for a
    # rank outside it cost no search.
    waited_by: dict[int, list[int]] = {}
    for v, out in edges.items():
        for w in out:
            waited_by.setdefault(w, []).append(v)
    left = {v: len(out) for v, out in edges.items()}
    dead = [v for v, n in left.items() if n == 0]
    while dead:
        w = dead.pop()
        for v in waited_by.get(w, ()):
            left[v] -= 1
            if left[v] == 0:
                dead.append(v)
    live = {v for v, n in left.items() if n > 0}
    edges = {v: [w for w in edges[v] if w in live] for v in live}
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    found: list[tuple[int, ...]] = []
    # Tarjan's algorithm, iterative: thousands of ranks would overflow Python's recursion limit.
    for root in sorted(edges):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work: list[tuple[int, Iterator[int]]] = [(root, iter(edges[root]))]
        while work:
            v, it = work[-1]
            child = next((w for w in it if w not in index or w in on_stack), None)
            if child is not None:
                if child in index:
                    low[v] = min(low[v], index[child])
                else:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(tuple(sorted(component)))
    return sorted(found)


def waiting_behind(graph: Mapping[int, Blocked], ranks: Iterable[int]) -> tuple[int, ...]:
    """Ranks outside `ranks` that wait on them, directly or through other waiting ranks."""
    inside = set(ranks)
    waiters: dict[int, list[int]] = {}
    for b in graph.values():
        for m in b.on:
            waiters.setdefault(m, []).append(b.rank)
    seen: set[int] = set()
    todo = list(inside)
    while todo:
        for w in waiters.get(todo.pop(), ()):
            if w not in inside and w not in seen:
                seen.add(w)
                todo.append(w)
    return tuple(sorted(seen))


def path(graph: Mapping[int, Blocked], start: int, members: Iterable[int]) -> list[int]:
    """A simple cycle through `start` inside `members` (a strongly connected set), as the ranks
    in wait order: start waits for path[1], which waits for path[2] ... which waits for start."""
    inside = set(members)
    parents: dict[int, int] = {}
    frontier = [start]
    while frontier:  # breadth first: the shortest cycle reads best
        nxt = []
        for v in frontier:
            for w in graph[v].on:
                if w == start:
                    out = [v]
                    while out[-1] != start:
                        out.append(parents[out[-1]])
                    return out[::-1]
                if w in inside and w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]
