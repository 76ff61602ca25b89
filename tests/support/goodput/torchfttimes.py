"""Where the wall time of the torchft stack went (tests/support/goodput/torchftkit.py): torchft
keeps the healthy replica group training while the failed one restarts, so the time a fault costs
is not a stretch in which nothing trains but the job's lost sample throughput:

    lost = stalled + missing

over the fault's window, from the last step committed before the fault to the first step that
every replica group committed again after the failed group's replacement joined (its own time
included). The window's committed steps, each k taking d_k (from the commit before it), m the
median d of the run's steps that every group took part in, share_k the groups that took part in
step k over all the groups:

- stalled: the time without committed progress: the window less the min(d_k, m) of its steps
  (a step slower than usual counts its excess here: a quorum or a collective waiting on a broken
  group, the healing of the returning group);
- missing: the time trained with groups missing, weighted by the share missing:
  the sum of (1 - share_k) x min(d_k, m).

With every group in every step this is 0 wherever the steps keep their usual pace; for a stack
that stops the whole job, stalled is its whole loss and missing is 0, so the figures compare.
Also given: the wall time trained with groups missing (unweighted), and, for the failed group
alone, the parts of tests/support/goodput/goodputtimes.py (its detection, teardown, restart and
restore, measured on its own ranks).

Goodput counts each committed step at its share of the groups (a step one group of two trained
is half a step of the job's work), and at most m of its time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from goodputkit import NODES, RANK_KINDS, Fault
from goodputtimes import Loss, RunTimes, analyse


@dataclass(frozen=True)
class Commit:
    step: int
    t: float  # the last group's commit of it
    t0: float  # the last group's start of it
    share: float  # the groups that took part, over all the groups
    pids: frozenset[int]


@dataclass(frozen=True)
class TorchftLoss(Loss):
    lost: float = 0.0  # stalled + missing
    stalled: float = 0.0
    missing: float = 0.0
    degraded: float = 0.0  # wall seconds trained with groups missing, unweighted
    window: float = 0.0

    @property
    def total(self) -> float:
        return self.lost


def commits(events: list[dict], groups: int) -> list[Commit]:
    """The job's committed steps in order: one per step number, merged over the groups that
    logged it; a step number below one already committed (a group training alone from nothing)
    is not the job's progress and is left out."""
    out: list[Commit] = []
    for e in sorted((e for e in events if e["ev"] == "step"), key=lambda e: e["t"]):
        share = min(1.0, int(e.get("replicas", groups)) / groups)
        if out and e["step"] == out[-1].step:
            c = out[-1]
            out[-1] = Commit(
                c.step, max(c.t, e["t"]), max(c.t0, e["t0"]), max(c.share, share),
                c.pids | {e["pid"]},
            )  # fmt: skip
        elif not out or e["step"] > out[-1].step:
            out.append(Commit(e["step"], e["t"], e["t0"], share, frozenset({e["pid"]})))
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _failed_node(f: Fault, nproc: int) -> str:
    return NODES[f.rank // nproc] if f.kind in RANK_KINDS else NODES[1]


def _node_losses(
    events: list[dict], faults: list[Fault], t0: float, wall: float, timeline: Path,
    pg_timeout: float, nproc: int,
) -> dict[int, Loss]:  # fmt: skip
    """goodputtimes' parts for each fault, measured on the failed group's ranks alone."""
    out: dict[int, Loss] = {}
    for node in NODES:
        mine = [f for f in faults if _failed_node(f, nproc) == node]
        sub = [e for e in events if e.get("node", node) == node]
        for loss in analyse(sub, mine, t0, wall, nproc, timeline, pg_timeout).losses:
            out[loss.fault.id] = loss
    return out


def analyse_torchft(
    events: list[dict], faults: list[Fault], t0: float, wall: float, world: int,
    timeline: Path, pg_timeout: float, nproc: int = 2,
) -> RunTimes:  # fmt: skip
    groups = world // nproc
    base = analyse(events, faults, t0, wall, world, timeline, pg_timeout)
    cs = commits(events, groups)
    gaps = [(cs[i], cs[i].t - cs[i - 1].t) for i in range(1, len(cs))]
    m = _median([d for c, d in gaps if c.share >= 1.0])
    started = {e["pid"]: (e["t"], e.get("node", "")) for e in events if e["ev"] == "start"}
    fired: dict[int, float] = {}
    for e in events:
        if e["ev"] == "fault" and e["id"] not in fired:
            fired[e["id"]] = e["t"]
    node_losses = _node_losses(events, faults, t0, wall, timeline, pg_timeout, nproc)
    losses: list[Loss] = []
    order = sorted((f for f in faults if f.id in fired), key=lambda f: fired[f.id])
    for i, f in enumerate(order):
        tf, node = fired[f.id], _failed_node(f, nproc)
        t_next = fired[order[i + 1].id] if i + 1 < len(order) else float("inf")
        new = {p for p, (ts, n) in started.items() if tf < ts < t_next and n == node}
        before = [c for c in cs if c.t <= tf]
        t_prev = before[-1].t if before else t0
        back = next((c for c in cs if c.t > tf and c.share >= 1.0 and c.pids & new), None)
        t_back = back.t if back is not None else None
        rejoined = [e["t"] for e in events if e["ev"] == "restored" and e["pid"] in new]
        if back is None and cs and len(rejoined) >= nproc and min(rejoined) > cs[-1].t:
            # Back only after the last step (the other group had finished and waited for it):
            # the window ends with that step; the wait after it trains nothing in any stack.
            t_back = cs[-1].t
        part = node_losses.get(f.id)
        if part is None:  # the failed group's own parts could not be read: only the window's
            part = Loss(f, tf, {}, None, 0, 0, None, "not recovered")
        if t_back is None:
            losses.append(replace(part, restored=None))
            continue
        healed = [e for e in events if e["ev"] == "restored" and e["pid"] in new]
        if part.restored is None:  # its parts unread: the step it healed to all the same
            part = replace(
                part, restored=min((e["step"] for e in healed), default=0),
                how="its group back after the last step" if back is None else "-",
            )  # fmt: skip
        sources = {e.get("source") or "-" for e in healed}
        part = replace(part, source="/".join(sorted(sources)) if sources else "-")
        stalled = missing = degraded = 0.0
        prev = t_prev
        for c in cs:
            if t_prev < c.t <= t_back:
                d = c.t - prev
                eff = min(d, m) if m else d
                stalled += d - eff
                missing += (1.0 - c.share) * eff
                degraded += eff if c.share < 1.0 else 0.0
                prev = c.t
        losses.append(
            TorchftLoss(
                part.fault, tf, part.parts, part.restored, part.trained, part.saved, part.latest,
                part.how, part.source, part.replica, stalled + missing, stalled, missing,
                degraded, t_back - t_prev,
            )
        )  # fmt: skip
    # A step's time past the usual is a wait (a quorum, a collective timing out), not training.
    kept = sum(c.share * (min(c.t - c.t0, m) if m else c.t - c.t0) for c in cs)
    return replace(base, kept=kept, losses=losses)


HEAD = (
    "| stack | fault (step) | lost (s) | stalled | missing (weighted) | trained with groups "
    "missing (s) | window (s) |"
)


def table(runs: dict[str, RunTimes | str], kinds: list[str]) -> list[str]:
    """The lines of the torchft breakdown table for the runs that have one ([] for none)."""
    rows = []
    for name, r in runs.items():
        if isinstance(r, str):
            continue
        for kind in kinds:
            for x in (x for x in r.losses if x.fault.kind == kind):
                if isinstance(x, TorchftLoss):
                    rows.append(
                        f"| {name} | {kind} ({x.fault.step}) | **{x.lost:.1f}** | "
                        f"{x.stalled:.1f} | {x.missing:.1f} | {x.degraded:.1f} | {x.window:.1f} |"
                    )
    if not rows:
        return []
    return ["", HEAD, "|---|---|---|---|---|---|---|", *rows]
