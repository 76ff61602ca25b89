"""Replication rounds, pure: which steps the agents send to their peers, and which steps every
rank keeps in memory so that a lost node and the nodes that survive it always share one.

A node lost with its memory comes back with the one replica its holder held; the job resumes
from a step only if every rank holds it. Nodes send their steps independently, so without
agreement the survivors may long have overwritten the step the lost node's holder holds (ranks
keep two slots; a replica that lags two steps behind had no partner). The invariant kept here:

    every rank holds in memory every step that a holder may be holding for any node.

The ranks agree on it at each save (one all-reduce they already make): a save starts a new
*round* only when every node's agent confirmed that all its holders hold the current round's
step; the saved step becomes the new round step (its snapshot is marked, and the agents send only
marked steps), and the confirmed step becomes the *kept* one. Until the next round starts, each
holder holds either the kept step (the new one has not reached it yet) or the round step (it
has), never anything else, so each rank keeps exactly those two, beside its newest snapshot.
Rounds follow the saves as fast as the pushes complete: with pushes shorter than a step, every
step is a round step and the kept step is the one before it. A push slower than a step only
spaces the rounds out; the invariant holds whatever the speed.

A rank whose own snapshot of the round step was lost (its copy failed, it was discarded) can
never be confirmed: it asks for the round to be abandoned, and the next save starts a new round
with the kept step unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rounds:
    current: int | None = None  # the round step being sent (not yet confirmed by every node)
    kept: int | None = None  # the newest round step every node's holders confirmed

    def keep(self) -> frozenset[int]:
        """The steps this rank must not write over."""
        return frozenset(s for s in (self.current, self.kept) if s is not None)


@dataclass(frozen=True)
class Vote:
    """One rank's part of the agreement, reduced over the ranks (all / any)."""

    ready: bool  # its agent confirmed the round step (or there is none, or it replicates nothing)
    replicating: bool  # its agent sends its node's snapshots to peers
    abandon: bool  # its own snapshot of the round step is gone: that round can never complete


def vote(
    rounds: Rounds,
    *,
    replicating: bool,
    confirmed: tuple[int, str] | None,
    run: str,
    holds_current: bool,
) -> Vote:
    """This rank's vote. `confirmed`: the newest round step (and launch) every holder of its node
    holds, as its agent said; `holds_current`: its own snapshot of the round step is complete."""
    if rounds.current is None or not replicating:
        return Vote(True, replicating, False)
    ready = confirmed is not None and confirmed[1] == run and confirmed[0] >= rounds.current
    return Vote(ready, True, not ready and not holds_current)


@dataclass(frozen=True)
class Agreed:
    all_ready: bool
    any_replicating: bool
    any_abandon: bool


def advance(rounds: Rounds, step: int, agreed: Agreed) -> tuple[Rounds, bool]:
    """The rounds after the save of `step`, and whether `step` is a round step (to be sent)."""
    if not agreed.any_replicating:
        return Rounds(), False
    if agreed.all_ready:
        kept = rounds.current if rounds.current is not None else rounds.kept
        return Rounds(current=step, kept=kept), True
    if agreed.any_abandon:
        return Rounds(current=step, kept=rounds.kept), True
    return rounds, False


def resumed(step: int | None, from_memory: bool) -> Rounds:
    """The rounds of a launch that resumed from `step`: a step every rank held in memory is
    kept until the first round is confirmed (the holders' replicas were of steps the ranks held,
    and each agent sends the newest round step its ranks hold, the resumed one among them)."""
    return Rounds(kept=step) if from_memory and step is not None else Rounds()
