"""Where the wall time of a goodput job went (tests/support/goodput/goodputkit.py), from its events: the
steps kept at the end, and per fault the time lost, split in six parts measured from timestamps:

- detection: the fault -> the first sign that something acted on it: the diag agent's verdict
  (`detected_at` of its verdict.json), else the first rank process of the attempt seen gone (not
  counting the rank killed, or the node lost, by the fault itself); 0 for a preemption, whose
  SIGTERM is its own notice;
- evidence: the verdict -> the first rank out (the agent writes its evidence before it stops or
  interrupts anything); 0 without a verdict;
- teardown: the first -> the last rank of the attempt out: its process gone, or (recovery in
  place) its attempt `ended` inside the process that goes on (for a preemption: from the
  SIGTERM, the drain's save included);
- restart: the last one out -> every rank of the attempt that trained on is `ready` (a new
  process, its imports, the rendezvous, the process group and the engine; a node coming back
  after a preemption or a loss included; in place: the next generation of the world formed and
  the engine built again in the same process, a warm spare's for a rank that died);
- restore: ready -> every rank `restored`;
- trained again: the steps thrown away: the end of the restored step in the attempt that was
  running (or the fault, if that step ended after it) -> the fault.

Their sum is the fault's share of the wall time: from the last step kept before it to the restore.
A rank process is seen gone by the harness's poll every 0.1 s.

Where each node's ranks restored from: memory (the node's own), replica (memory its agent pulled
from a peer's at its start), storage; one word when every node's is the same.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

from goodputkit import Fault

PARTS = ("detection", "evidence", "teardown", "restart", "restore", "trained again")


@dataclass(frozen=True)
class Loss:
    fault: Fault
    at: float  # wall time of the fault
    parts: dict[str, float]  # PARTS -> seconds (empty when not recovered)
    restored: int | None  # the step the job resumed from (None: it never did)
    trained: int  # newest step every rank of the broken attempt trained
    saved: int  # newest step every rank of the broken attempt saved (a save returned)
    latest: int | None  # the step storage's `latest` named at the fault (node faults)
    how: str  # what ended the broken attempt
    source: str = "-"  # where the ranks restored from (see the top), "-" when unknown
    replica: int | None = None  # the step a peer held for the lost node when it went

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class RunTimes:
    t0: float  # wall time of the start
    wall: float
    kept: float  # seconds of the steps kept (each step's last instance, start to end)
    startup: float  # the first launch -> every rank restored
    losses: list[Loss]
    curve: list[tuple[float, int]]  # (seconds since the start, step) of one rank
    step_s: float  # median seconds per step
    save_s: float  # median seconds per save that saved something
    saves: int  # how many of those
    unfinished: str = ""  # why the job did not finish its steps ("" when it did)

    @property
    def goodput(self) -> float:
        return self.kept / self.wall if self.wall else 0.0


def _verdicts(timeline: Path) -> list[tuple[float, dict]]:
    out = []
    if not timeline.is_dir():
        return out
    for p in timeline.rglob("verdict.json"):
        try:
            doc = json.loads(p.read_text())
            at = dt.datetime.fromisoformat(doc["detected_at"]).timestamp()
        except (OSError, ValueError, KeyError):
            continue
        out.append((at, doc))
    return sorted(out, key=lambda x: x[0])


def _sources(restored_rows: list[dict], pulled: dict[str, str]) -> str:
    """Where each node's ranks restored from, `pulled` naming where each node's agent took their
    snapshots from at its start (agent.replica.ring's sources: local, peer, storage, none)."""
    by_node: dict[str, set[str]] = {}
    for x in restored_rows:
        node, source = x.get("node", ""), x.get("source") or "-"
        if source == "memory" and pulled.get(node) == "peer":
            source = "replica"
        by_node.setdefault(node, set()).add(source)
    words = {n: "/".join(sorted(v)) for n, v in sorted(by_node.items())}
    if len(set(words.values())) == 1:
        return next(iter(words.values()))
    return ", ".join(f"{n} {w}" for n, w in words.items())


def _next_attempt(
    by_pid: dict[int, list[dict]], tf: float, t_next: float
) -> tuple[list[dict], list[dict]]:
    """The `ready` and `restored` rows of each rank's attempt that trained on after the fault: a
    new process's, or one recovering in place (which logs them again): per process, the last of
    each after the fault and before its first step after them."""
    ready_rows, restored_rows = [], []
    for rows in by_pid.values():
        ready = restored = None
        for x in sorted(rows, key=lambda r: r["t"]):
            if not tf < x["t"] < t_next:
                continue
            if x["ev"] == "ready":
                ready, restored = x, None
            elif x["ev"] == "restored" and ready is not None:
                restored = x
            elif x["ev"] == "step" and ready is not None and restored is not None:
                ready_rows.append(ready)
                restored_rows.append(restored)
                break
    return ready_rows, restored_rows


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def analyse(
    events: list[dict], faults: list[Fault], t0: float, wall: float, world: int,
    timeline: Path, pg_timeout: float,
) -> RunTimes:  # fmt: skip
    start = {e["pid"]: e for e in events if e["ev"] == "start"}
    gone = {e["rank_pid"]: e["t"] for e in events if e["ev"] == "gone"}
    by_pid: dict[int, list[dict]] = {}
    for e in events:
        by_pid.setdefault(e["pid"], []).append(e)
    steps = [e for e in events if e["ev"] == "step"]
    verdicts = _verdicts(timeline)
    fired: dict[int, dict] = {}
    for e in events:
        if e["ev"] == "fault" and e["id"] not in fired:
            fired[e["id"]] = e
    times = sorted((fired[f.id]["t"], f) for f in faults if f.id in fired)
    losses = []
    for i, (tf, f) in enumerate(times):
        t_next = times[i + 1][0] if i + 1 < len(times) else float("inf")
        e = fired[f.id]
        old = [p for p, s in start.items() if s["t"] < tf and gone.get(p, float("inf")) >= tf]
        # When each rank's broken attempt ended: its process gone, or (in place) the wrapper
        # ending the attempt inside the process that goes on.
        ended = {
            p: min([gone.get(p, float("inf"))] + [
                x["t"] for x in by_pid.get(p, []) if x["ev"] == "ended" and tf <= x["t"] < t_next
            ])
            for p in old
        }  # fmt: skip
        faulty = set()
        if f.kind == "kill":
            faulty = {e["pid"]}
        elif f.kind == "lost":
            faulty = {p for p in old if start[p].get("node") == "node-b"}
        # What the broken attempt's ranks did in all of it: a peer may finish the save of a step
        # a moment after the fault, a drain trains on to the step it saves.
        old_steps = [s for s in steps if s["pid"] in old and s["t"] <= ended[s["pid"]]]
        per_rank: dict[int, int] = {}
        for s in old_steps:
            per_rank[s["pid"]] = max(per_rank.get(s["pid"], 0), s["step"])
        trained = min(per_rank.values()) if len(per_rank) >= world else 0
        saved_rank: dict[int, int] = {}
        for s in events:
            if s["ev"] == "saved" and s["pid"] in old and s["t"] <= ended[s["pid"]]:
                saved_rank[s["pid"]] = max(saved_rank.get(s["pid"], 0), s["step"])
        saved = min(saved_rank.values()) if len(saved_rank) >= world else 0
        ready_rows, restored_rows = _next_attempt(by_pid, tf, t_next)
        kept_on = [x["pid"] for x in ready_rows if x["pid"] in old]  # recovered in place
        pulled = {
            x["node"]: x["source"] for x in events if x["ev"] == "pulled" and tf < x["t"] < t_next
        }
        if len(restored_rows) < world or len(ready_rows) < world:
            losses.append(Loss(
                f, tf, {}, None, trained, saved, e.get("latest"), "not recovered",
                replica=e.get("replica"),
            ))  # fmt: skip
            continue
        restored = min(x["step"] for x in restored_rows)
        t_ready = max(x["t"] for x in ready_rows)
        t_restored = max(x["t"] for x in restored_rows)
        out = {p: t for p, t in ended.items() if t != float("inf")}
        reacting = [t for p, t in out.items() if p not in faulty]
        t_first = tf if f.kind == "preempt" else min(reacting, default=tf)
        t_all = max(out.values(), default=t_first)
        found = [
            (t, d) for t, d in verdicts if tf - 1 <= t <= t_first + 0.5 and f.kind != "preempt"
        ]  # fmt: skip
        verdict = found[0] if found else None
        # Named after the first verdict to name a culprit (another node's may only say that its
        # ranks wait for that one's), timed by the first.
        named = next((v for v in found if v[1].get("culprit") is not None), verdict)
        # Only a hang verdict acts (it stops the ranks, after the evidence); after a death the
        # launchers act on their own, the agent's evidence alongside.
        acts = verdict is not None and verdict[1].get("kind") != "rank_exited"
        t_detect = min(verdict[0], t_first) if acts and verdict else t_first
        base = [
            x["t"] for x in events
            if x["t"] < tf and x.get("step") == restored and x["ev"] in ("step", "restored")
        ]  # fmt: skip
        t_base = max(base) if base else tf
        parts = {
            "detection": max(0.0, t_detect - tf),
            "evidence": max(0.0, t_first - t_detect),
            "teardown": max(0.0, t_all - t_first),
            "restart": max(0.0, t_ready - t_all),
            "restore": max(0.0, t_restored - t_ready),
            "trained again": max(0.0, tf - t_base),
        }
        if named:
            d = named[1]
            how = f"agent verdict: {d.get('kind')}, rank {d.get('culprit')} on {d.get('node')}"
        elif f.kind == "preempt":
            how = "SIGTERM to node-b's pod"
        elif parts["detection"] >= 0.9 * pg_timeout:
            how = f"the peers' collective timeout ({pg_timeout:g} s)"
        else:
            how = "a rank's exit, seen by its launcher"
        if kept_on:
            how += f"; {len(kept_on)} of {world} ranks recovered in place"
        losses.append(Loss(
            f, tf, parts, restored, trained, saved, e.get("latest"), how,
            _sources(restored_rows, pulled), e.get("replica"),
        ))  # fmt: skip
    last: dict[int, dict] = {}
    for s in steps:
        if s["step"] not in last or s["t"] > last[s["step"]]["t"]:
            last[s["step"]] = s
    kept = sum(s["t"] - s["t0"] for s in last.values())
    first_restored = sorted(x["t"] for x in events if x["ev"] == "restored")[:world]
    startup = (max(first_restored) - t0) if len(first_restored) == world else 0.0
    one = min((s["rank"] for s in steps), default=0)
    curve = [
        (x["t"] - t0, x["step"]) for x in events
        if x["ev"] in ("step", "restored") and x.get("rank") == one
    ]  # fmt: skip
    saves = [x["t"] - x["t0"] for x in events if x["ev"] == "saved"]
    return RunTimes(
        t0, wall, kept, startup, losses, sorted(curve), _median([s["t"] - s["t0"] for s in steps]),
        _median(saves), len(saves),
    )  # fmt: skip
