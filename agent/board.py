"""The peer board: agents of one job share what their ranks are doing through small files in a
shared directory (by default `<timeline>/.peers`, the timeline being a volume all nodes mount).

Each agent publishes its ranks' progress every few seconds. When a verdict points at ranks on
other nodes, the agent reads the board once and runs its analysis again with those ranks in view,
so it can name the exact remote rank and node instead of "somewhere else". Reading happens only
then, so a thousand-node job does not make a thousand agents poll a shared filesystem.

Times travel as ages relative to the writer's wall clock at writing time; the reader turns them
into its own monotonic clock. Node clocks are assumed NTP-synchronised (milliseconds), far below
the seconds that hang limits are made of.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.agent.observation import Liveness, Observation, OpView, RankSnapshot
from diag.collector.meta import safe_job_name, write_atomic
from diag.collector.records import OpCode, OpState

log = logging.getLogger(__name__)

BOARD_FORMAT = "diag.board/1"


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


def board_document(obs: Observation, node: str, wall: float) -> dict[str, Any]:
    now = obs.now
    return {
        "format": BOARD_FORMAT,
        "job": obs.job,
        "node": node,
        "attempt": obs.attempt,
        "written_wall": wall,
        "groups": {name: list(ranks) for name, ranks in obs.groups.items()},
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


def snapshots_from(doc: dict[str, Any], now: float, wall: float) -> list[RankSnapshot]:
    """Remote ranks of one board document, on this agent's monotonic clock."""
    if doc.get("format") != BOARD_FORMAT:
        raise ValueError(f"not a {BOARD_FORMAT} document")
    # `now` on our clock corresponds to `wall` on the writer's; the document is that much older.
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


@dataclass
class Board:
    directory: Path
    node: str
    publish_every: float = 2.0
    max_age: float = 30.0  # entries older than this are from agents that stopped publishing
    _last_publish: float = float("-inf")

    def _dir(self, job: str) -> Path:
        return self.directory / safe_job_name(job or "job")

    def publish(self, obs: Observation, *, force: bool = False) -> None:
        if not obs.ranks or (not force and obs.now - self._last_publish < self.publish_every):
            return
        self._last_publish = obs.now
        doc = board_document(obs, self.node, time.time())
        d = self._dir(obs.job)
        try:
            d.mkdir(parents=True, exist_ok=True)
            write_atomic(d / f"{_safe(self.node)}.json", json.dumps(doc).encode())
        except OSError as e:
            log.debug("cannot publish to the peer board %s: %s", d, e)

    def peers(
        self, obs: Observation, since: float = float("-inf")
    ) -> tuple[list[RankSnapshot], dict[str, tuple[int, ...]]]:
        """Ranks other nodes' agents published for this job and attempt, and their groups.
        Entries written before `since` (our monotonic clock: when the wait being judged began)
        are left out: a rank seen before the others started waiting would look behind."""
        wall = time.time()
        ranks: list[RankSnapshot] = []
        groups: dict[str, tuple[int, ...]] = {}
        local = {r.rank for r in obs.ranks}
        d = self._dir(obs.job)
        try:
            files = sorted(d.glob("*.json"))
        except OSError:
            return ranks, groups
        for path in files:
            if path.name == f"{_safe(self.node)}.json":
                continue
            try:
                doc = json.loads(path.read_text())
                if int(doc.get("attempt", -1)) != obs.attempt:
                    continue
                age = wall - float(doc["written_wall"])
                if age > self.max_age or obs.now - age < since:
                    continue
                snaps = snapshots_from(doc, obs.now, wall)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.debug("ignoring peer board entry %s: %s", path, e)
                continue
            ranks.extend(s for s in snaps if s.rank not in local)
            for name, members in doc.get("groups", {}).items():
                groups.setdefault(str(name), tuple(int(m) for m in members))
        return ranks, groups


def _safe(node: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in node)[:100] or "node"
