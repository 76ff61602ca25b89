"""The pure core of in-place recovery: what a failed attempt of the training function was (a
fault, or the user's own error) and what the rank does next, from plain facts and `now`.

A fault is something that ends an attempt while the process is sound: a collective that failed
because a peer is gone or timed out, a fault another rank posted for this generation, or this
rank interrupted (by its watcher or the agent's verdict). Everything else is the user's error and
is raised as it would be without the wrapper. A fault is recovered in place, in a new generation
of the world, until the policy's budget is spent; then the rank gives up, and its launcher
restarts every process (a full restart, as without the wrapper).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

# What a collective's error says when its peer is gone or late (gloo's and NCCL's messages, and
# torch's own when a group was aborted under it). Lower case; matched as substrings.
PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "read error",
    "write error",
    "has been aborted",
    "aborted",
    "nccl communicator was aborted",
    "ncclremoteerror",
)
TIMED_OUT = ("timed out", "timeout", "watchdog caught collective operation timeout")
# Errors torch raises when the group a call used is gone (aborted by this rank's watcher).
GROUP_GONE = (
    "default process group has not been initialized",
    "invalid process group",
    "process group has been destroyed",
)
# Error types a failed collective raises (torch.distributed's DistError family and RuntimeError).
COLLECTIVE_TYPES = (
    "RuntimeError",
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "ValueError",  # torch's "Default process group has not been initialized"
)


class FaultKind(enum.Enum):
    PEER_LOST = "peer_lost"  # a collective failed: a peer closed its connection
    TIMED_OUT = "timed_out"  # a collective (or the store) waited past its timeout
    POSTED = "posted"  # another rank posted a fault for this generation
    INTERRUPTED = "interrupted"  # this rank was interrupted (watcher, the agent's verdict)


class Action(enum.Enum):
    RECOVER = "recover"  # re-form the world in place and run the function again
    GIVE_UP = "give_up"  # raise: the launcher restarts every rank
    RAISE = "raise"  # not a fault: the user's error, raised as without the wrapper


@dataclass(frozen=True)
class Policy:
    max_recoveries: int = 20  # in place, within `window_s`; past it the rank gives up
    window_s: float = 3600.0


@dataclass(frozen=True)
class Failure:
    """One attempt's end, as plain facts."""

    error_type: str  # the exception's class name (and its bases', see `classify`)
    message: str
    posted: bool = False  # a fault is posted for this generation (by any rank)
    interrupted: bool = False  # this rank's watcher marked a fault before the error


@dataclass(frozen=True)
class History:
    generation: int = 0
    recoveries: tuple[float, ...] = ()  # when each recovery began (monotonic seconds)


@dataclass(frozen=True)
class Decision:
    action: Action
    fault: FaultKind | None
    generation: int  # the generation to form next (RECOVER), else the current one
    reason: str


def classify(failure: Failure) -> FaultKind | None:
    """The fault this failure was, or None for the user's own error. A rank that was told of a
    fault (posted, or interrupted) counts whatever ended its attempt as that fault: its groups
    were aborted under it, so any error it raised after is the fault's."""
    if failure.interrupted:
        return FaultKind.INTERRUPTED
    if failure.posted:
        return FaultKind.POSTED
    types = {t.strip() for t in failure.error_type.split(",")}
    if not types & set(COLLECTIVE_TYPES):
        return None
    text = failure.message.lower()
    if any(s in text for s in TIMED_OUT):
        return FaultKind.TIMED_OUT
    if any(s in text for s in PEER_GONE + GROUP_GONE):
        return FaultKind.PEER_LOST
    return None


def decide(policy: Policy, history: History, failure: Failure, now: float) -> Decision:
    """What this rank does after `failure` ended its attempt in `history.generation`."""
    fault = classify(failure)
    g = history.generation
    if fault is None:
        return Decision(Action.RAISE, None, g, f"not a fault: {failure.error_type}")
    recent = [t for t in history.recoveries if now - t < policy.window_s]
    if len(recent) >= policy.max_recoveries:
        return Decision(
            Action.GIVE_UP, fault, g,
            f"{fault.value}: {len(recent)} recoveries in place within {policy.window_s:.0f} s "
            f"(at most {policy.max_recoveries}); a full restart instead",
        )  # fmt: skip
    return Decision(Action.RECOVER, fault, g + 1, f"{fault.value} in generation {g}")


def recovered(history: History, decision: Decision, now: float) -> History:
    """The history once `decision` (RECOVER) began at `now`."""
    return replace(history, generation=decision.generation, recoveries=(*history.recoveries, now))


def reform_failed(history: History, error: str) -> Decision:
    """Forming a generation failed (a rank did not join in time): give up, a full restart."""
    return Decision(
        Action.GIVE_UP, None, history.generation,
        f"generation {history.generation} could not form ({error}); a full restart instead",
    )  # fmt: skip
