"""Which rank is most likely at fault when others wait: cross-rank comparison of journals.

Collectives are issued in the same order on every member of a group, so per-group sequence
numbers line up across ranks (the idea behind PyTorch's flight-recorder analysis). When some
members wait inside collective #N of a group, every other member should be there too. A member
that is not is the suspect:
- it left: it ended cleanly (or left the process group) while others went on to ops that need
  it (leaver.py); whatever happens to them next is its consequence;
- it is dead;
- it is behind (its newest op on that group is older than #N) and not inside any collective: it
  is computing, sleeping, spinning or stuck in something that is not communication;
- it is behind but waits inside an op of another group or with another peer: follow it there;
  when the waits lead back (a wait-for cycle: a deadlock), name the rank whose order of ops
  differs from the others' (waitgraph.py, deadlock.py);
- it is inside #N but its device has not started it while the others' have (CUDA);
- its oldest op is on the device and never started there while no other rank waits on it (a
  single rank, or a group whose others are not inside anything): its own stream is blocked by
  earlier work (a kernel that never ends);
- it called a different collective as #N (op or size mismatch);
- it is on another node (we cannot see it from here: the job verdict, which weighs every node's
  view, names it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from diag.agent.detect.deadlock import find_deadlocks, ranks_text
from diag.agent.detect.leaver import find_leavers
from diag.agent.detect.observation import Observation, OpView, RankSnapshot
from diag.agent.detect.waitgraph import arrived, blocked_ranks, wait_key
from diag.formats.records import OpState


class SuspectKind(enum.Enum):
    LEFT = "left"  # ended (or left the process group) while others went on to ops needing it
    DIED = "died"
    BEHIND_IDLE = "behind"  # behind in the group and not inside any collective
    DEADLOCK = "deadlock"  # on a wait-for cycle, its order of ops differing from the others'
    NOT_STARTED = "device-not-started"
    MISMATCH = "mismatch"
    REMOTE = "remote"  # a member on another node
    LAST_ARRIVAL = "last-arrival"  # everybody is inside; the latest to arrive, as a weak hint


_SCORES = {
    SuspectKind.LEFT: 1.1,  # what follows (peers failing, hanging, killed) is its consequence
    SuspectKind.DIED: 1.0,
    SuspectKind.BEHIND_IDLE: 0.9,
    SuspectKind.DEADLOCK: 0.85,
    SuspectKind.NOT_STARTED: 0.8,
    SuspectKind.MISMATCH: 0.7,
    SuspectKind.REMOTE: 0.5,
    SuspectKind.LAST_ARRIVAL: 0.2,
}


@dataclass(frozen=True)
class Suspect:
    rank: int
    kind: SuspectKind
    reason: str

    @property
    def score(self) -> float:
        return _SCORES[self.kind]


@dataclass(frozen=True)
class Wait:
    """Ranks stuck inside one collective, or inside one p2p op between two ranks."""

    group: str
    group_seq: int
    op: OpView
    waiting: tuple[int, ...]
    since: float  # the earliest enqueue among them
    pair: tuple[int, int] | None = None  # the two ranks of a p2p op

    @property
    def members(self) -> tuple[int, ...] | None:
        """The ranks it needs, when that is not the whole group."""
        return self.pair

    def describe(self) -> str:
        between = f" between ranks {self.pair[0]} and {self.pair[1]}" if self.pair else ""
        return f"{self.op.op.label} #{self.group_seq} of group {self.group}{between}"


def _fmt_ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def waits(obs: Observation, local_only: bool = True) -> list[Wait]:
    """Collectives that ranks are stuck in, oldest first, one per (group, seq): local ranks
    only, or with `local_only=False` also the remote ranks the observation carries."""
    by_key: dict[tuple[Any, ...], list[tuple[RankSnapshot, OpView]]] = {}
    for r in obs.ranks if local_only else obs.all_ranks:
        if r.alive and r.pending:
            op = r.pending[0]
            by_key.setdefault(wait_key(r.rank, op), []).append((r, op))
    out = [
        Wait(
            group=key[0],
            group_seq=key[1],
            op=members[0][1],
            waiting=tuple(sorted(r.rank for r, _ in members)),
            since=min(op.t_enqueue for _, op in members),
            pair=(key[2], key[3]) if len(key) == 4 else None,
        )
        for key, members in by_key.items()
    ]
    out.sort(key=lambda w: w.since)
    return out


def _behind_reason(r: RankSnapshot, w: Wait, now: float, node: str) -> str:
    if w.pair is not None:
        other = w.pair[0] if w.pair[1] == r.rank else w.pair[1]
        hist = r.p2p.get((w.group, other), ())
        where = (
            f"its last op with rank {other} was {hist[-1].op.label} #{hist[-1].group_seq}"
            if hist
            else f"it has exchanged nothing with rank {other} on group {w.group}"
        )
    else:
        last = r.last_ops.get(w.group)
        where = (
            f"its last op on group {w.group} was #{last.group_seq}"
            if last
            else (f"it has issued nothing on group {w.group}")
        )
    idle = now - r.last_activity
    who = f"rank {r.rank} on node {r.node}" if r.node != node else f"rank {r.rank}"
    if r.phase:
        doing = f"in phase {r.phase!r}"
    elif r.proc_state == "D":
        doing = "in uninterruptible sleep (D state: I/O or driver)"
    elif r.cpu_busy >= 0.5:
        doing = f"busy on CPU ({r.cpu_busy:.0%} of a core) outside any collective"
    else:
        doing = "idle outside any collective"
    verb = "waits" if len(w.waiting) == 1 else "wait"
    return (
        f"{ranks_text(w.waiting)} {verb} in {w.describe()} since "
        f"{now - w.since:.1f} s; {who} never joined: {where}, no progress for "
        f"{idle:.1f} s, {doing}"
    )


def find_suspects(obs: Observation) -> list[Suspect]:
    """Suspects, most likely first. Empty when no local rank waits in a collective."""
    now = obs.now
    found: dict[int, Suspect] = {}

    def add(s: Suspect) -> None:
        old = found.get(s.rank)
        if old is None or s.score > old.score:
            found[s.rank] = s

    by_rank = {r.rank: r for r in obs.all_ranks}
    local_node = obs.ranks[0].node if obs.ranks else ""
    for r in obs.all_ranks:
        if r.liveness.value == "died":
            add(Suspect(r.rank, SuspectKind.DIED, _died_reason(r, obs)))
    for lv in find_leavers(obs):
        add(Suspect(lv.rank.rank, SuspectKind.LEFT, lv.describe(local_node)))

    for w in waits(obs, local_only=False):
        members = w.members or obs.groups.get(w.group, ())
        waiting = set(w.waiting)
        remote_reason = ""
        for m in members:
            if m in waiting:
                continue
            r = by_rank.get(m)
            if r is None:
                # One text per wait, shared by every rank it waits for: with thousands of
                # ranks waiting and thousands missing, a text each would be quadratic.
                remote_reason = remote_reason or (
                    f"ranks {_fmt_ranks(w.waiting)} wait for it in {w.describe()}; it runs "
                    "on another node (the job verdict names the culprit)"
                )
                add(Suspect(m, SuspectKind.REMOTE, remote_reason))
                continue
            if not r.alive:
                continue  # reported as dead above (or closed: then the others wait in vain)
            if arrived(r, w.waiting[0], by_rank[w.waiting[0]].pending[0]):
                continue  # inside it or past it: not the blocker
            if r.pending:
                continue  # waiting elsewhere: the wait it is in gets its own analysis
            add(Suspect(m, SuspectKind.BEHIND_IDLE, _behind_reason(r, w, now, local_node)))
        _mismatches(w, by_rank, add)
        _not_started(w, by_rank, add)

    _blocked_on_device(obs, add)

    # Waits that lead back to where they started: nobody on the cycle can move first.
    for d in find_deadlocks(obs, blocked_ranks(obs)):
        for c in d.culprits:
            add(Suspect(c, SuspectKind.DEADLOCK, d.reasons[c]))

    if not found:
        # Everyone is inside the same collective: the transport or a device is stuck. The rank
        # that arrived last is the only (weak) lead.
        ws = waits(obs, local_only=False)
        if ws:
            w = ws[0]
            arrivals = [
                (by_rank[m].pending[0].t_enqueue, m)
                for m in w.waiting
                if by_rank.get(m) and by_rank[m].pending
            ]
            if len(arrivals) > 1:
                t, last = max(arrivals)
                add(
                    Suspect(
                        last,
                        SuspectKind.LAST_ARRIVAL,
                        f"all local members of group {w.group} are inside {w.describe()}; rank "
                        f"{last} arrived last ({t - w.since:.2f} s after the first): the "
                        "collective itself is stuck (network, transport or device)",
                    )
                )
    return sorted(found.values(), key=lambda s: (-s.score, s.rank))


def _died_reason(r: RankSnapshot, obs: Observation) -> str:
    when = f"{obs.now - r.exited_at:.1f} s ago" if r.exited_at is not None else "earlier"
    doing = (
        r.pending[0].describe()
        if r.pending
        else (f"phase {r.phase!r}" if r.phase else f"step {r.step}")
    )
    node = f" on node {r.node}" if obs.ranks and r.node != obs.ranks[0].node else ""
    return (
        f"rank {r.rank} (pid {r.pid}){node} exited {when} without closing its journal, "
        f"during {doing}"
    )


def _mismatches(w: Wait, by_rank: dict[int, RankSnapshot], add: Callable[[Suspect], None]) -> None:
    ops = [(by_rank[m].pending[0], m) for m in w.waiting if by_rank[m].pending]
    if len(ops) < 3:
        return
    shapes: dict[tuple[Any, ...], list[int]] = {}
    for op, m in ops:
        shapes.setdefault((op.op, op.nbytes), []).append(m)
    if len(shapes) < 2:
        return
    majority = max(shapes.items(), key=lambda kv: len(kv[1]))
    for (code, nbytes), ranks in shapes.items():
        if ranks is majority[1]:
            continue
        for m in ranks:
            add(
                Suspect(
                    m,
                    SuspectKind.MISMATCH,
                    f"as #{w.group_seq} of group {w.group} it called {code.label} of {nbytes} "
                    f"bytes; ranks {_fmt_ranks(majority[1])} called "
                    f"{majority[0][0].label} of {majority[0][1]} bytes",
                )
            )


def _not_started(w: Wait, by_rank: dict[int, RankSnapshot], add: Callable[[Suspect], None]) -> None:
    states = {m: by_rank[m].pending[0].state for m in w.waiting if by_rank[m].pending}
    started = [m for m, s in states.items() if s == OpState.STARTED]
    if not started:
        return
    for m, s in states.items():
        if s == OpState.ENQUEUED:
            add(
                Suspect(
                    m,
                    SuspectKind.NOT_STARTED,
                    f"its device has not started {w.describe()} while ranks "
                    f"{_fmt_ranks(started)} have: the kernels queued before it are stuck",
                )
            )


BLOCKED_ON_DEVICE = (
    "enqueued on the device but never started: the stream is blocked by earlier work"
)


def _blocked_on_device(obs: Observation, add: Callable[[Suspect], None]) -> None:
    """A rank whose oldest pending op was enqueued on its device and never started there, with
    nobody else waiting on it: nothing outside the rank holds that op back (its peers are not
    inside anything it could wait for), so what holds it is its own stream: earlier work that
    does not end. With peers inside the op and started, `_not_started` says it better."""
    waiting = {r.rank for r in obs.all_ranks if r.alive and r.pending}
    for r in obs.all_ranks:
        op = r.oldest_pending
        if not (r.alive and op is not None and op.on_device and op.state == OpState.ENQUEUED):
            continue
        if op.is_p2p:
            others: tuple[int, ...] = (op.peer,) if op.peer >= 0 else ()
        else:
            others = tuple(m for m in obs.groups.get(op.group, ()) if m != r.rank)
        if any(m in waiting for m in others):
            continue
        age = obs.now - op.t_enqueue
        add(
            Suspect(
                r.rank,
                SuspectKind.NOT_STARTED,
                f"rank {r.rank}: {op.describe()} {BLOCKED_ON_DEVICE} (enqueued {age:.1f} s ago)",
            )
        )
