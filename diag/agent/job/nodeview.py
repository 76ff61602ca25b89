"""A node's view of its ranks at an incident, as it travels in the node's report for the job
verdict (`verdict.py`): enough of every local rank (liveness, step, pending and last ops per
group) for whoever assembles the job verdict to run the culprit analysis over all nodes' ranks
at once. Nothing is written in steady state: a view is taken once, when the node's own verdict
is reached.

Times travel as ages relative to the writer's wall clock at writing time; the reader turns them
into its own clock. Node clocks are assumed NTP-synchronised (milliseconds), far below the
seconds that hang limits are made of.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from diag.agent.detect.culprit import SuspectKind, find_suspects
from diag.agent.detect.deadlock import NO_ONE_STANDS_OUT
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.job import waiters
from diag.formats.checkedjson import NAME, Fields
from diag.formats.records import OpCode, OpState

# /2: ranks that only wait travel in the compact `waiting` blocks (waiters.py); /1 has none.
VIEW_FORMAT = "diag.view/2"
VIEW_FORMATS = frozenset(("diag.view/1", VIEW_FORMAT))
# Bounds on a view from another node: a job of 16,000 nodes has 128,000 ranks; a node, 8-16.
MAX_RANKS = 1 << 20  # world size, and so every rank number
MAX_NODE_RANKS = 4096  # ranks in one view
MAX_GROUPS = 4096  # process groups in one view
MAX_OPS = 4096  # ops of one rank in one list
# Group members expanded from spans, in one view and over all views of an analysis: each rank
# is in a handful of groups (world, data-, tensor-, pipeline-parallel), so this is many times a
# 128,000-rank job's; a view that claims more is left out rather than expanded.
MAX_MEMBERS = 1 << 22
_OPS = frozenset(OpCode.__members__)
_STATES = frozenset(OpState.__members__)
_LIVENESS = frozenset(x.value for x in Liveness)


def _op_doc(op: OpView, now: float) -> dict[str, Any]:
    return {
        "group": op.group,
        "seq": op.group_seq,
        "op": op.op.name,
        "state": op.state.name,
        "nbytes": op.nbytes,
        "peer": op.peer,
        "age": round(now - op.t_enqueue, 4),
        "end_age": round(now - op.t_end, 4) if op.t_end is not None else None,
    }


def _op_view(d: dict[str, Any], now: float) -> OpView:
    return OpView(
        group=str(d["group"]),
        group_seq=int(d["seq"]),
        op=OpCode[d["op"]],
        state=OpState[d["state"]],
        nbytes=int(d["nbytes"]),
        t_enqueue=now - float(d["age"]),
        t_end=now - float(d["end_age"]) if d.get("end_age") is not None else None,
        peer=int(d.get("peer", -1)),
    )


def _spans(ranks: tuple[int, ...]) -> list[list[int]]:
    """[[first, last], ...]: a 16,000-rank world group is one pair, not 16,000 numbers."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def view_document(obs: Observation, node: str, wall: float) -> dict[str, Any]:
    """The local ranks of `obs` (not the remote ones it may hold), on the writer's wall clock."""
    now = obs.now
    waiting, rest = waiters.split(obs.ranks, now)
    return {
        "format": VIEW_FORMAT,
        "job": obs.job,
        "node": node,
        "attempt": obs.attempt,
        "written_wall": wall,
        "world_size": obs.world_size,
        "groups": {name: _spans(ranks) for name, ranks in obs.groups.items()},
        "ranks": [
            {
                "rank": r.rank,
                "local_rank": r.local_rank,
                "pid": r.pid,
                "liveness": r.liveness.value,
                "step": r.step,
                "phase": r.phase,
                "last_activity_age": round(now - r.last_activity, 4),
                "exited_age": round(now - r.exited_at, 4) if r.exited_at is not None else None,
                "proc_state": r.proc_state,
                "cpu_busy": round(r.cpu_busy, 3),
                "pending": [_op_doc(op, now) for op in r.pending[:4]],
                "last_ops": [_op_doc(op, now) for op in r.last_ops.values()],
                "p2p": [_op_doc(op, now) for ops in r.p2p.values() for op in ops[-4:]],
            }
            | ({"left_group": True} if r.left_group else {})
            for r in (obs.ranks[i] for i in rest)
        ],
        "waiting": waiting,
    }


def _one_of(f: Fields, key: str, allowed: frozenset[str]) -> None:
    v = f.d.get(key)
    if not isinstance(v, str) or v not in allowed:
        raise f.fail(key, f"is not one of {', '.join(sorted(allowed))}")


def _check_op(f: Fields, *, with_ages: bool = True) -> None:
    f.str("group")
    f.int("seq", 0, 2**63)
    _one_of(f, "op", _OPS)
    _one_of(f, "state", _STATES)
    f.int("nbytes", 0, 2**63)
    f.int("peer", -1, MAX_RANKS - 1, -1)
    if with_ages:
        f.float("age")
        f.opt_float("end_age")


def check_view(doc: object, source: str) -> dict[str, Any]:
    """`doc` when it is a view whose every field `snapshots_from` and `groups_from` read has our
    type and bounds; raises UntrustedInput naming `source` and the field otherwise."""
    f = Fields(doc, source, "view")
    if f.d.get("format") not in VIEW_FORMATS:
        raise f.fail("format", f"is not {VIEW_FORMAT}")
    f.str("node")
    f.str("job", "")
    f.int("attempt", 0, 2**31, 0)
    f.float("written_wall")
    f.int("world_size", 0, MAX_RANKS, 0)
    groups = f.obj("groups") if "groups" in f.d else None
    members = 0
    if groups is not None:
        if len(groups.d) > MAX_GROUPS:
            raise f.fail("groups", f"has {len(groups.d)} groups, over the limit of {MAX_GROUPS}")
        for name in groups.d:
            if len(name) > NAME:
                raise groups.fail(name[:40], "is not a group's name")
            for i, span in enumerate(groups.list(name, MAX_RANKS)):
                if (
                    not isinstance(span, list)
                    or len(span) != 2
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in span)
                    or not 0 <= span[0] <= span[1] < MAX_RANKS
                ):
                    raise groups.fail(f"{name}[{i}]", f"is not a span of ranks below {MAX_RANKS}")
                members += span[1] - span[0] + 1
    if members > MAX_MEMBERS:
        raise f.fail("groups", f"name {members} members, over the limit of {MAX_MEMBERS}")
    full = f.list("ranks", MAX_NODE_RANKS)
    if (
        waiters.check(f, MAX_RANKS, MAX_NODE_RANKS - len(full), _check_op)
        and f.d.get("format") != VIEW_FORMAT
    ):
        raise f.fail("waiting", f"is not part of {f.d.get('format')}")
    for r in f.objs("ranks", MAX_NODE_RANKS):
        r.int("rank", 0, MAX_RANKS - 1)
        r.int("local_rank", -1, MAX_NODE_RANKS, -1)
        r.int("pid", 0, 2**31, 0)
        _one_of(r, "liveness", _LIVENESS)
        r.float("last_activity_age")
        r.opt_float("exited_age")
        r.bool("left_group", False)
        r.int("step", -1, 2**63, 0)
        r.str("phase", "")
        r.str("proc_state", "")
        r.float("cpu_busy", 0.0)
        for key in ("pending", "last_ops", "p2p"):
            for op in r.objs(key, MAX_OPS):
                _check_op(op)
    return f.d


def groups_from(
    doc: dict[str, Any], known: frozenset[str] = frozenset(), budget: int = MAX_MEMBERS
) -> dict[str, tuple[int, ...]]:
    """The process groups a view knows (but those in `known`), name -> global ranks of the
    members. A group's name is the same on every node, so each is expanded once. Raises
    ValueError rather than expand more than `budget` members."""
    spans = {
        str(name): [(int(a), int(b)) for a, b in s]
        for name, s in doc.get("groups", {}).items()
        if str(name) not in known
    }
    if sum(b - a + 1 for s in spans.values() for a, b in s) > budget:
        raise ValueError(f"its groups name over {budget} members")
    return {name: tuple(r for a, b in s for r in range(a, b + 1)) for name, s in spans.items()}


def snapshots_from(doc: dict[str, Any], now: float, wall: float) -> list[RankSnapshot]:
    """The ranks of one view, on the reader's clock: `now` on it is `wall` on the writer's.
    Raises ValueError on a document that is not a view."""
    if doc.get("format") not in VIEW_FORMATS:
        raise ValueError(f"not a {VIEW_FORMAT} document")
    # The document is this much older than `now`.
    at = now - max(0.0, wall - float(doc["written_wall"]))
    out = waiters.expand(doc, str(doc["node"]), at)
    for r in doc["ranks"]:
        last_ops = {}
        for d in r.get("last_ops", ()):
            v = _op_view(d, at)
            last_ops[v.group] = v
        p2p: dict[tuple[str, int], list[OpView]] = {}
        for d in r.get("p2p", ()):
            v = _op_view(d, at)
            p2p.setdefault((v.group, v.peer), []).append(v)
        out.append(
            RankSnapshot(
                rank=int(r["rank"]),
                local_rank=int(r.get("local_rank", -1)),
                pid=int(r.get("pid", 0)),
                node=str(doc["node"]),
                liveness=Liveness(r["liveness"]),
                started_at=0.0,
                last_activity=at - float(r["last_activity_age"]),
                step=int(r.get("step", 0)),
                phase=str(r.get("phase", "")),
                exited_at=at - float(r["exited_age"]) if r.get("exited_age") is not None else None,
                left_group=r.get("left_group") is True,
                pending=tuple(_op_view(d, at) for d in r.get("pending", ())),
                last_ops=last_ops,
                p2p={k: tuple(sorted(v, key=lambda o: o.group_seq)) for k, v in p2p.items()},
                proc_state=str(r.get("proc_state", "")),
                cpu_busy=float(r.get("cpu_busy", 0.0)),
            )
        )
    return out


@dataclass(frozen=True)
class Attribution:
    """What the nodes' views say together."""

    culprit: int | None
    node: str  # the culprit's node, "" when no view carries it
    reason: str


def _absent(world_size: int, seen: set[int]) -> list[int]:
    return [r for r in range(world_size) if r not in seen]


def _span_text(ranks: list[int]) -> str:
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in _spans(tuple(ranks)))


_RANK_LIST = re.compile(r"\d+(?:,\d+){3,}")


def fold_rank_lists(text: str) -> str:
    """Long lists of ranks in a reason ("ranks 0,1,2,...,127999 wait in ...") as spans
    ("ranks 0-6,8-127999 wait in ..."): a job verdict's text does not grow with the job."""

    def fold(m: re.Match[str]) -> str:
        ranks = [int(r) for r in m.group(0).split(",")]
        spans = [f"{a}-{b}" if a != b else str(a) for a, b in _spans(tuple(ranks))]
        if len(spans) > 12:  # with gaps everywhere (nodes that filed nothing): a sample
            spans = [*spans[:8], f"... ({len(ranks)} ranks in {len(spans)} runs) ...", *spans[-2:]]
        return ",".join(spans)

    return _RANK_LIST.sub(fold, text)


def expand(doc: dict[str, Any]) -> list[RankSnapshot] | None:
    """A view's ranks as `analyse` takes them in `expanded`: a claimant expands each view once,
    as it reads it, while it waits; None for what is not a view."""
    try:
        wall = float(doc["written_wall"])
        return snapshots_from(doc, wall, wall)
    except (ValueError, KeyError, TypeError, OverflowError):
        return None


@dataclass
class _Part:
    """The ranks and groups of one attempt's views, as `analyse` gathers them."""

    ranks: dict[int, RankSnapshot] = field(default_factory=dict)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    members: int = 0
    world: int = 0
    latest: float = -math.inf  # the latest writing time of its views (their clocks)

    def add(self, d: dict[str, Any], snaps: list[RankSnapshot]) -> None:
        try:
            more = groups_from(d, frozenset(self.groups), MAX_MEMBERS - self.members)
        except (ValueError, KeyError, TypeError, OverflowError):
            return  # not a view (read back checked, so only one made here by hand)
        self.members += sum(len(m) for m in more)
        self.groups.update(more)
        for s in snaps:
            self.ranks.setdefault(s.rank, s)
            self.world = max(self.world, s.rank + 1)
        self.world = max(self.world, min(MAX_RANKS, int(d.get("world_size", 0))))


class Gathered:
    """Views added one by one (a claimant adds each as it reads it, while it waits for the
    rest): their ranks and groups gathered as `analyse` does, so that when the last view comes
    only the analysis itself is left to run (`attribution`)."""

    def __init__(self) -> None:
        self._parts: dict[int, _Part] = {}
        self._docs: list[tuple[dict[str, Any], list[RankSnapshot] | None]] = []

    def add(self, d: object, snaps: list[RankSnapshot] | None = None) -> None:
        """`snaps`: the view's `expand`, where already done."""
        if not isinstance(d, dict) or d.get("format") not in VIEW_FORMATS:
            return
        part = self._parts.setdefault(int(d.get("attempt", 0)), _Part())
        self._docs.append((d, snaps))
        try:
            wall = float(d["written_wall"])
            part.add(d, snaps if snaps is not None else snapshots_from(d, wall, wall))
        except (ValueError, KeyError, TypeError, OverflowError):
            return
        part.latest = max(part.latest, wall)

    def attribution(self, now_wall: float) -> Attribution:
        """What the views of the newest attempt say together, at `now_wall` (this reader's
        clock)."""
        if not self._parts:
            return Attribution(None, "", "no node filed a readable view of its ranks")
        attempt = max(self._parts)
        part = self._parts[attempt]
        if part.latest > now_wall:
            # A writer's clock is ahead of ours: its view is taken as written now (the others
            # as gathered, at their writing time).
            part = _Part()
            for d, snaps in self._docs:
                if int(d.get("attempt", 0)) != attempt:
                    continue
                try:
                    if snaps is None or float(d["written_wall"]) > now_wall:
                        snaps = snapshots_from(d, now_wall, now_wall)
                    part.add(d, snaps)
                except (ValueError, KeyError, TypeError, OverflowError):
                    continue
        return _attribute(part, attempt, now_wall)


def analyse(
    views: list[dict[str, Any]],
    now_wall: float,
    expanded: Sequence[list[RankSnapshot] | None] | None = None,
) -> Attribution:
    """The culprit analysis over the ranks of every view at once, as if one agent watched the
    whole job: a rank behind in a collective that ranks of other nodes wait in, a dead rank, a
    cross-node deadlock. Views that are not views (or of another attempt than the newest) are
    left out. `now_wall` is this reader's wall clock. `expanded`: each view's `expand`, in the
    order of `views`, where already done."""
    g = Gathered()
    for i, d in enumerate(views):
        g.add(d, expanded[i] if expanded is not None else None)
    return g.attribution(now_wall)


def _attribute(part: _Part, attempt: int, now_wall: float) -> Attribution:
    ranks, world = part.ranks, part.world
    if not ranks:
        return Attribution(None, "", "no node filed a readable view of its ranks")
    obs = Observation(
        now=now_wall,
        ranks=tuple(sorted(ranks.values(), key=lambda r: r.rank)),
        groups=part.groups,
        world_size=world,
        attempt=attempt,
    )
    suspects = find_suspects(obs)
    if not suspects:
        return Attribution(None, "", "no rank waits for another in the views")
    lead = suspects[0]
    if lead.kind == SuspectKind.REMOTE:
        absent = _absent(world, set(ranks))
        if len(absent) == 1:
            return Attribution(
                absent[0], "", f"no node reported rank {absent[0]}, and the others wait for it"
            )
        return Attribution(
            None, "", f"no report carries {len(absent)} ranks ({_span_text(absent)}): {lead.reason}"
        )
    if NO_ONE_STANDS_OUT in lead.reason:
        return Attribution(None, "", lead.reason)
    return Attribution(lead.rank, ranks[lead.rank].node, lead.reason)
