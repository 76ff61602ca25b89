"""A node's view of its ranks at an incident, as it travels in the node's report for the job
verdict (`jobverdict.py`): enough of every local rank (liveness, step, pending and last ops per
group) for whoever assembles the job verdict to run the culprit analysis over all nodes' ranks
at once. Nothing is written in steady state: a view is taken once, when the node's own verdict
is reached.

Times travel as ages relative to the writer's wall clock at writing time; the reader turns them
into its own clock. Node clocks are assumed NTP-synchronised (milliseconds), far below the
seconds that hang limits are made of.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from diag.agent.culprit import SuspectKind, find_suspects
from diag.agent.deadlock import NO_ONE_STANDS_OUT
from diag.agent.observation import Liveness, Observation, OpView, RankSnapshot
from diag.collector.records import OpCode, OpState

VIEW_FORMAT = "diag.view/1"


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
            for r in obs.ranks
        ],
    }


def groups_from(
    doc: dict[str, Any], known: frozenset[str] = frozenset()
) -> dict[str, tuple[int, ...]]:
    """The process groups a view knows (but those in `known`), name -> global ranks of the
    members. A group's name is the same on every node, so each is expanded once."""
    return {
        str(name): tuple(r for first, last in spans for r in range(int(first), int(last) + 1))
        for name, spans in doc.get("groups", {}).items()
        if str(name) not in known
    }


def snapshots_from(doc: dict[str, Any], now: float, wall: float) -> list[RankSnapshot]:
    """The ranks of one view, on the reader's clock: `now` on it is `wall` on the writer's.
    Raises ValueError on a document that is not a view."""
    if doc.get("format") != VIEW_FORMAT:
        raise ValueError(f"not a {VIEW_FORMAT} document")
    # The document is this much older than `now`.
    at = now - max(0.0, wall - float(doc["written_wall"]))
    out = []
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


def analyse(views: list[dict[str, Any]], now_wall: float) -> Attribution:
    """The culprit analysis over the ranks of every view at once, as if one agent watched the
    whole job: a rank behind in a collective that ranks of other nodes wait in, a dead rank, a
    cross-node deadlock. Views that are not views (or of another attempt than the newest) are
    left out. `now_wall` is this reader's wall clock."""
    docs = [d for d in views if isinstance(d, dict) and d.get("format") == VIEW_FORMAT]
    attempt = max((int(d.get("attempt", 0)) for d in docs), default=0)
    ranks: dict[int, RankSnapshot] = {}
    groups: dict[str, tuple[int, ...]] = {}
    world = 0
    for d in docs:
        if int(d.get("attempt", 0)) != attempt:
            continue
        try:
            snaps = snapshots_from(d, now_wall, now_wall)
            groups.update(groups_from(d, frozenset(groups)))
        except (ValueError, KeyError, TypeError):
            continue
        for s in snaps:
            ranks.setdefault(s.rank, s)
            world = max(world, s.rank + 1)
        world = max(world, int(d.get("world_size", 0)))
    if not ranks:
        return Attribution(None, "", "no node filed a readable view of its ranks")
    obs = Observation(
        now=now_wall,
        ranks=tuple(sorted(ranks.values(), key=lambda r: r.rank)),
        groups=groups,
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
