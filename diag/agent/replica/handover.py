"""Whether a holder writes a lost peer's replica to storage: the decision.

Pure: the replicas this node holds, what storage holds of each one's step, whether each peer's
agent answers (and since when it does not), and whether this node's own ranks were stopped (an
incident, a death) in; a verdict per peer out.

Why: when a node is lost and the job shrinks instead of getting a replacement, that node's part
of the newest step lives only in its holder's memory. Written to storage by the holder, the step
commits (`latest` moves only once every rank's part is there), and the smaller job resumes from it
through the universal checkpoint instead of from an older persisted step.

The rules:
- only while this node's own ranks were stopped: a lost node stops the whole job, so the
  survivors' ranks die or are stopped too; a healthy job never writes replicas;
- only a peer whose agent has not answered for `lost_after` seconds: a live peer persists its own
  ranks' snapshots (its agent does on their death), and two writers of one part are avoided; a
  peer that answers is asked again until its parts are on storage or it goes silent;
- only a replica newer than the step storage names, and only its ranks whose part of that step,
  from the same launch, is not on storage yet;
- once per replica (peer, step, launch): a later trigger does not write it again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HeldReplica:
    """A complete replica this node holds for a peer."""

    peer: str
    step: int
    run: str  # the trainer launch that took it
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class StorageView:
    """What storage holds for the replica's step: the committed step, and the ranks whose part of
    the replica's step from the replica's launch is there (their done-markers)."""

    latest: int | None
    done: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Reach:
    """Whether the peer's replica server answered at the last probe; `since`: since when it has
    been in that state (the first probe that saw it so), on the monotonic clock."""

    answers: bool
    since: float


@dataclass(frozen=True)
class PeerFacts:
    replica: HeldReplica
    storage: StorageView
    reach: Reach | None  # None: not probed yet


class Verdict(enum.Enum):
    PERSIST = "persist"  # write `ranks` of the replica to storage now
    WAIT = "wait"  # unreachable, not yet for long enough (or not probed): ask again
    ALIVE = "alive"  # its agent answers: it persists its own (watched until it did, or is silent)
    ON_STORAGE = "on storage"  # storage names that step or a newer one, or has every part
    DONE = "done"  # this node wrote it already
    NO_INCIDENT = "no incident"  # this node's ranks run: nothing was lost


@dataclass(frozen=True)
class Handover:
    peer: str
    step: int
    verdict: Verdict
    reason: str
    ranks: tuple[int, ...] = ()  # the parts to write (PERSIST)


def decide_handover(
    facts: Sequence[PeerFacts],
    *,
    stopped: bool,
    lost_after: float,
    now: float,
    written: frozenset[tuple[str, int, str]] = frozenset(),
) -> list[Handover]:
    """One verdict per held replica, in the order given. `stopped`: this node's own ranks died or
    were stopped; `written`: the (peer, step, launch) replicas this node wrote before."""
    return [_one(f, stopped, lost_after, now, written) for f in facts]


def _one(
    f: PeerFacts,
    stopped: bool,
    lost_after: float,
    now: float,
    written: frozenset[tuple[str, int, str]],
) -> Handover:
    r = f.replica

    def out(verdict: Verdict, reason: str, ranks: tuple[int, ...] = ()) -> Handover:
        return Handover(r.peer, r.step, verdict, reason, ranks)

    if (r.peer, r.step, r.run) in written:
        return out(Verdict.DONE, f"step {r.step} written before")
    if not stopped:
        return out(Verdict.NO_INCIDENT, "this node's ranks are not stopped")
    latest = f.storage.latest
    if latest is not None and latest >= r.step:
        return out(Verdict.ON_STORAGE, f"storage names step {latest}")
    missing = _missing(r, f.storage)
    if not missing:
        return out(Verdict.ON_STORAGE, f"every part of step {r.step} is on storage")
    if f.reach is None:
        return out(Verdict.WAIT, "not asked yet")
    if f.reach.answers:
        return out(Verdict.ALIVE, "its agent answers: it persists its own ranks")
    silent = now - f.reach.since
    if silent < lost_after:
        return out(Verdict.WAIT, f"silent for {silent:.1f} s of {lost_after:g}")
    return out(
        Verdict.PERSIST,
        f"silent for {silent:.1f} s; storage names "
        f"{'no step' if latest is None else f'step {latest}'}",
        missing,
    )


def _missing(r: HeldReplica, storage: StorageView) -> tuple[int, ...]:
    return tuple(sorted(set(r.ranks) - storage.done))


def wants_reach(
    replica: HeldReplica, storage: StorageView, written: frozenset[tuple[str, int, str]]
) -> bool:
    """Whether the peer's agent is worth asking: only for a replica storage still lacks."""
    if (replica.peer, replica.step, replica.run) in written:
        return False
    if storage.latest is not None and storage.latest >= replica.step:
        return False
    return bool(_missing(replica, storage))


def look_again(handovers: Sequence[Handover]) -> bool:
    """Whether to ask again later: a peer silent for too short a time, or one whose agent
    answers but whose parts are not on storage yet (it may be persisting them, or die before)."""
    return any(h.verdict in (Verdict.WAIT, Verdict.ALIVE) for h in handovers)


def next_reach(previous: Reach | None, answers: bool, now: float) -> Reach:
    """The peer's reach after a probe: `since` moves only when the state changes."""
    if previous is not None and previous.answers == answers:
        return previous
    return Reach(answers, now)
