"""A rank that left while its peers still needed it: the cause of what follows.

A common bug: one rank's data runs out a few steps before the others' (uneven shards), so it
leaves its training loop and ends normally (or calls `destroy_process_group` and goes on alone),
while its peers still issue collectives that need it. The peers then fail (gloo: the connection
closes), hang (NCCL) or are killed by the launcher; whichever rank fails first is not the one to
blame.

Collectives are issued in the same order on every member of a group, so a rank's newest op on a
group says how far it went there. A rank that closed its journal (it ended, or left the default
process group) is a leaver when another rank went on to an op of a group it belongs to that it
never reached: a collective with a higher sequence number on that group, or a point-to-point op
with it beyond their last exchange. It never joins that op, whatever it was doing before.
A job that ends normally on every rank has no leaver: every rank reached the same last op.
Groups of a world formed again since (in-place recovery) are settled history: only the groups
of the newest world the rank was in count.

Pure: snapshots in, leavers out; no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.formats.worlds import world_of


@dataclass(frozen=True)
class Leaver:
    rank: RankSnapshot
    went_on: tuple[int, ...]  # the ranks that went on to ops that need it
    op: OpView  # the first such op (one of theirs)
    last: OpView | None  # its own last op on that op's group (or with that peer)

    @property
    def ended_at(self) -> float:
        """When it left: when its process was seen to end, else its last sign of activity."""
        r = self.rank
        return r.exited_at if r.exited_at is not None else r.last_activity

    def how(self) -> str:
        r = self.rank
        if r.left_group:
            if r.exited_at is None:
                return "left the process group (destroy_process_group) and runs on alone"
            return "left the process group (destroy_process_group) and ended"
        # Its journal was closed at interpreter exit (a normal return or sys.exit; an uncaught
        # exception would have said FAILED), whether or not the process is gone yet.
        return "ended cleanly (its journal closed at exit, no uncaught exception)"

    def where(self) -> str:
        last = f"its last op: {self.last.describe()}" if self.last else "no op on that group"
        return f"after step {self.rank.step} ({last})"

    def describe(self, local_node: str = "") -> str:
        r = self.rank
        node = f" on node {r.node}" if local_node and r.node != local_node else ""
        who = "rank" if len(self.went_on) == 1 else "ranks"
        return (
            f"rank {r.rank}{node} {self.how()} {self.where()} while {who} "
            f"{_ranks(self.went_on)} went on to {self.op.describe()}: its data may have run out "
            "before theirs"
        )


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 12:
        return f"{ranks[0]}-{ranks[-1]} ({len(ranks)} ranks)"
    return ",".join(map(str, ranks))


def find_leavers(obs: Observation) -> list[Leaver]:
    """Ranks (local or in the remote views) that closed their journal before ops of others that
    need them: the one that left first first."""
    ranks = obs.all_ranks
    closed = [r for r in ranks if r.liveness == Liveness.CLOSED]
    if not closed:
        return []
    # The furthest op per group across all ranks, once: a leaver is behind it on a group it
    # belongs to. Linear in the ranks, whatever the number of closed ones.
    furthest: dict[str, int] = {}
    for r in ranks:
        for g, op in r.last_ops.items():
            if op.group_seq > furthest.get(g, -1):
                furthest[g] = op.group_seq
    members: dict[str, frozenset[int]] = {}
    out = []
    for c in closed:
        found = _collective(c, obs, ranks, furthest, members) or _p2p(c, ranks)
        if found is not None:
            out.append(found)
    out.sort(key=lambda lv: (lv.ended_at, lv.rank.rank))
    return out


def _collective(
    c: RankSnapshot,
    obs: Observation,
    ranks: tuple[RankSnapshot, ...],
    furthest: dict[str, int],
    members: dict[str, frozenset[int]],
) -> Leaver | None:
    world = max((world_of(g) for g in c.last_ops), default=0)
    for g, top in sorted(furthest.items()):
        if world_of(g) < world:
            continue  # a world re-formed since: its ops were given up on every rank
        mine = c.last_ops.get(g)
        reached = mine.group_seq if mine is not None else -1
        if top <= reached:
            continue
        if g not in members:
            members[g] = frozenset(obs.groups.get(g, ()))
        if c.rank not in members[g]:
            continue
        ahead = [
            (r.last_ops[g], r.rank)
            for r in ranks
            if r.rank != c.rank and g in r.last_ops and r.last_ops[g].group_seq > reached
        ]
        first_op = min(ahead, key=lambda a: (a[0].group_seq, a[1]))[0]
        return Leaver(c, tuple(sorted(rk for _, rk in ahead)), first_op, mine)
    return None


def _p2p(c: RankSnapshot, ranks: tuple[RankSnapshot, ...]) -> Leaver | None:
    """A peer's pending point-to-point op with it beyond their last exchange."""
    for r in ranks:
        if r.rank == c.rank or not r.alive:
            continue
        for op in r.pending:
            if not op.is_p2p or op.peer != c.rank:
                continue
            hist = c.p2p.get((op.group, r.rank), ())
            last = hist[-1] if hist else None
            if last is None or last.group_seq < op.group_seq:
                return Leaver(c, (r.rank,), op, last)
    return None
