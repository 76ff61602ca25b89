"""When a rank gives up on the drain and leaves at once, without a save.

A stop request (SIGTERM, ...) is normally honoured at the next step boundary: the ranks agree,
save the same step and leave. That needs every rank alive and able to reach a boundary. When a
peer is gone or hung, a launcher's SIGTERM (torchrun stops the other workers of a group in which
one died; an agent stops one node's ranks while the other node's sit in a collective) would be
swallowed by the flag while the rank cannot drain anyway, and the rank would linger until the
launcher's SIGKILL (torchrun: 30 s) or until the interpreter has finished tearing itself down.
The rule, for a rank with a request pending:

- the ranks could not agree on it, or the drain's closing barrier failed (a collective raised:
  a peer is gone): leave now;
- the process is already leaving (an error ended the training loop, the exit handlers run):
  leave now, without finalizing the interpreter;
- the drain is saving: wait (its collectives raise if a peer dies, which is the case above);
- training, the signal's Python handler run: wait. The main thread runs Python, so it is in a
  step, however long (the agent's rank deadline and the launcher's SIGKILL bound that);
- training, the handler not run for `grace` since the signal came: the main thread is blocked
  in a C call that ignores signals (a gloo collective waiting on a hung peer): leave now.
  `grace` is `step_factor` times the longest recent step, at least `min_grace_s`; before any
  step was timed there is nothing to compare with, so the rank waits.

Leaving without a save loses nothing that was safe: the newest complete flash snapshot is in
shared memory (its completeness marker is written last) and the agent persists it; a storage
save writes `latest` only after every rank's files are on storage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    TRAINING = "training"  # between boundaries, or agreeing at one
    SAVING = "saving"  # the agreed drain is saving
    LEAVING = "leaving"  # the process is exiting (exit handlers run)
    DONE = "done"  # the drain saved; nothing left to decide


class Action(enum.Enum):
    WAIT = "wait"
    LEAVE_NOW = "leave now"


@dataclass(frozen=True)
class AbandonPolicy:
    min_grace_s: float = 5.0
    step_factor: float = 3.0

    def __post_init__(self) -> None:
        if self.min_grace_s <= 0 or self.step_factor < 1:
            raise ValueError(
                f"min_grace_s must be > 0 and step_factor >= 1, not "
                f"{self.min_grace_s} and {self.step_factor}"
            )


DEFAULT_POLICY = AbandonPolicy()


@dataclass(frozen=True)
class DrainProgress:
    requested_at: float | None  # monotonic time of the stop request; None: none
    phase: Phase
    step_s: float | None  # the longest recent step; None: none timed yet
    # Monotonic time since which a drain signal came that the main thread has not yet handled
    # in Python (it has run no bytecode since); None: every signal handled, or none came.
    unhandled_since: float | None = None
    agreement_failed: bool = False  # an agreement or the drain's barrier raised


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str
    recheck_s: float | None  # when to look again; None: only when something changes


def decide(p: DrainProgress, now: float, policy: AbandonPolicy = DEFAULT_POLICY) -> Verdict:
    if p.requested_at is None or p.phase is Phase.DONE:
        return Verdict(Action.WAIT, "no stop pending", None)
    if p.agreement_failed:
        return Verdict(Action.LEAVE_NOW, "the ranks cannot agree: a peer is gone", None)
    if p.phase is Phase.LEAVING:
        return Verdict(Action.LEAVE_NOW, "the stop came while the process was leaving", None)
    if p.phase is Phase.SAVING:
        return Verdict(Action.WAIT, "the drain is saving", 1.0)
    if p.unhandled_since is None:
        return Verdict(Action.WAIT, "the main thread runs Python: the step goes on", None)
    if p.step_s is None:
        return Verdict(Action.WAIT, "no step timed yet", 1.0)
    grace = max(policy.min_grace_s, policy.step_factor * p.step_s)
    waited = now - p.unhandled_since
    if waited >= grace:
        return Verdict(
            Action.LEAVE_NOW,
            f"the signal not handled for {waited:.1f} s (steps take up to {p.step_s:.2f} s): "
            f"stuck in a collective that will not complete",
            None,
        )
    return Verdict(Action.WAIT, "the main thread is in a C call", min(grace - waited, 1.0))
