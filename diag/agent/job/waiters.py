"""The compact form of a view's ranks that only wait (`nodeview.py`): most ranks of a stalled
job sit in one collective and have done nothing else since, so a node's view says "these ranks
wait in all_reduce #N of group G", the op once, and per rank only what differs (its pid, its
step, when it entered, ...): a few numbers instead of a nested object each. The claimant of a
fallback reads thousands of views; this is what makes each one small to read, check and expand.

Lossless: a rank is written this way only when `snapshots_from` gives back the same snapshot
as from its full entry (one pending op, that op its group's last, nothing else to tell).
"""

from __future__ import annotations

import math
from typing import Any

from diag.agent.detect.observation import Liveness, OpView, RankSnapshot
from diag.formats.checkedjson import Fields
from diag.formats.records import OpCode, OpState

# A waiting rank's numbers, in this order.
ROW = ("rank", "local_rank", "pid", "step", "last_activity_age", "age", "proc_state", "cpu_busy")


def _plain(r: RankSnapshot) -> bool:
    if not (r.alive and len(r.pending) == 1) or r.p2p or r.phase or r.left_group:
        return False
    op = r.pending[0]
    return (
        op.t_end is None
        and not op.is_p2p
        and r.exited_at is None
        and len(r.last_ops) == 1
        and r.last_ops.get(op.group) == op
    )


def _key(op: OpView) -> tuple[str, int, str, str, int, int]:
    return (op.group, op.group_seq, op.op.name, op.state.name, op.nbytes, op.peer)


def split(ranks: tuple[RankSnapshot, ...], now: float) -> tuple[list[dict[str, Any]], list[int]]:
    """(the waiting blocks of the ranks that only wait, the indexes of the others)."""
    blocks: dict[tuple[str, int, str, str, int, int], list[list[Any]]] = {}
    rest = []
    for i, r in enumerate(ranks):
        if not _plain(r):
            rest.append(i)
            continue
        op = r.pending[0]
        blocks.setdefault(_key(op), []).append([
            r.rank, r.local_rank, r.pid, r.step, round(now - r.last_activity, 4),
            round(now - op.t_enqueue, 4), r.proc_state, round(r.cpu_busy, 3),
        ])  # fmt: skip
    out = [
        {"op": dict(zip(("group", "seq", "op", "state", "nbytes", "peer"), k, strict=True)),
         "ranks": rows}
        for k, rows in blocks.items()
    ]  # fmt: skip
    return out, rest


def check(f: Fields, max_rank: int, max_ranks: int, check_op: Any) -> int:
    """Checks the view's `waiting` blocks (`f`: the view); returns how many ranks they hold."""
    count = 0
    for b in f.objs("waiting", max_ranks):
        check_op(b.obj("op"), with_ages=False)
        for i, row in enumerate(b.list("ranks", max_ranks)):
            problem = _row_problem(row, max_rank, max_ranks)
            if problem:
                raise b.fail(f"ranks[{i}]", problem)
            count += 1
    if count > max_ranks:
        raise f.fail("waiting", f"holds {count} ranks, over the limit of {max_ranks}")
    return count


_NUMBER = (int, float)


def _row_problem(row: object, max_rank: int, max_ranks: int) -> str:
    """What is wrong with a waiting rank's row, "" when nothing (one plain test per field: a
    claimant checks 128,000 rows)."""
    if not isinstance(row, list) or len(row) != len(ROW):
        return f"must be a row of {', '.join(ROW)}"
    rank, local, pid, step, idle, age, proc_state, cpu = row
    if not (
        type(rank) is int
        and type(local) is int
        and type(pid) is int
        and type(step) is int
        and type(idle) in _NUMBER
        and type(age) in _NUMBER
        and type(cpu) in _NUMBER
        and type(proc_state) is str
        and len(proc_state) <= 8
    ):
        return f"must be a row of {', '.join(ROW)}"
    if not (math.isfinite(idle) and math.isfinite(age) and math.isfinite(cpu)):
        return "holds a number out of range"
    if not (
        0 <= rank < max_rank
        and -1 <= local <= max_ranks
        and 0 <= pid < 2**31
        and -1 <= step < 2**63
    ):
        return f"{row[:4]} is out of range"
    return ""


def ranks_of(doc: dict[str, Any]) -> list[int]:
    return [int(row[0]) for b in doc.get("waiting", ()) for row in b["ranks"]]


def expand(doc: dict[str, Any], node: str, at: float) -> list[RankSnapshot]:
    """The waiting ranks of a view as snapshots; `at`: the view's writing time on the reader's
    clock."""
    out = []
    for b in doc.get("waiting", ()):
        o = b["op"]
        group, seq, code = str(o["group"]), int(o["seq"]), OpCode[o["op"]]
        state, nbytes, peer = OpState[o["state"]], int(o["nbytes"]), int(o.get("peer", -1))
        first = OpView(group, seq, code, state, nbytes, at, None, peer)
        model = RankSnapshot(
            rank=0, local_rank=0, pid=0, node=node, liveness=Liveness.RUNNING, started_at=0.0,
            last_activity=at, step=0, pending=(first,), last_ops={group: first},
        )  # fmt: skip
        # The block's ranks differ from `model` in their row only: each is `model`'s fields
        # with its row's, set at once rather than one by one through the frozen dataclass's
        # __init__ (3x faster; a claimant expands 128,000 of them). Equal to a constructed one.
        op_fields, rank_fields = vars(first), vars(model)
        for rank, local, pid, step, idle, age, proc_state, cpu in b["ranks"]:
            op = _new(OpView)
            vars(op).update(op_fields, t_enqueue=at - float(age))
            snap = _new(RankSnapshot)
            vars(snap).update(
                rank_fields, rank=int(rank), local_rank=int(local), pid=int(pid),
                last_activity=at - float(idle), step=int(step), pending=(op,),
                last_ops={group: op}, proc_state=str(proc_state), cpu_busy=float(cpu),
            )  # fmt: skip
            out.append(snap)
    return out


_new = object.__new__
