"""The pure core of `diag launch`'s worker policy: the node's workers as plain facts in, one
action out (with its reason), `now` passed in.

A failure is replaced in place (REPLACE_ONE) only when that is sure to help: one worker failed
while the others still run, its rank had said it recovers in place (it runs under
`diag.trainer.resilient`, so the survivors wait to form the next generation with its
replacement), it was not itself a replacement that died soon after it started, and its rank's
replacements are within budget. Anything else is torchrun's behaviour: every worker restarts
(RESTART_ALL), or, with no failures left in `--max-restarts`, the job fails (FAIL). A
replacement spends one of `--max-restarts` as a restart does: a job survives as many failures
as torchrun would let it, only more cheaply.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # exited 0
    FAILED = "failed"  # exited non-zero or by a signal


class Action(enum.Enum):
    CONTINUE = "continue"  # every worker runs (or some finished): keep watching
    REPLACE_ONE = "replace_one"  # start a replacement for the failed worker's rank only
    RESTART_ALL = "restart_all"  # torchrun's restart: stop every worker, rendezvous, start all
    FAIL = "fail"  # no failures left: stop every worker, the launch fails
    DONE = "done"  # every worker exited 0


@dataclass(frozen=True)
class Worker:
    local_rank: int
    rank: int
    state: State
    exit_code: int | None = None  # negative: killed by that signal
    resilient: bool = False  # its rank runs under diag.trainer.resilient
    started_at: float = 0.0  # when this worker's process took the rank (monotonic seconds)
    replacement: bool = False  # it took a dead worker's place
    replacements: int = 0  # how often its rank was replaced since every worker last started


@dataclass(frozen=True)
class Facts:
    workers: tuple[Worker, ...]
    failures_left: int  # what --max-restarts still allows (restarts and replacements)
    spares_ready: int  # spares alive on this node
    spares_warm: int = 0  # of them, those done importing


@dataclass(frozen=True)
class Policy:
    spares: int = 1  # warm spares per node; 0: a replacement is a cold start
    spare_delay_s: float = 15.0  # from a worker seen under resilient to the spares' start
    per_rank: int = 3  # replacements of one rank before every worker restarts instead
    settle_s: float = 60.0  # a replacement that dies sooner than this did not take the place


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    local_rank: int | None = None  # REPLACE_ONE: whose place
    warm: bool = False  # REPLACE_ONE: a warm spare takes it (else a cold start)


def decide(policy: Policy, facts: Facts, now: float) -> Decision:
    failed = [w for w in facts.workers if w.state is State.FAILED]
    if not failed:
        if facts.workers and all(w.state is State.SUCCEEDED for w in facts.workers):
            return Decision(Action.DONE, "every worker exited 0")
        return Decision(Action.CONTINUE, "")
    what = ", ".join(f"rank {w.rank} {_exit_text(w.exit_code)}" for w in failed)
    if facts.failures_left <= 0:
        return Decision(Action.FAIL, f"{what}; no restarts left (--max-restarts)")
    if len(failed) > 1:
        return Decision(Action.RESTART_ALL, f"{what}: more than one worker failed at once")
    w = failed[0]
    done = [x.rank for x in facts.workers if x.state is State.SUCCEEDED]
    if done:
        return Decision(Action.RESTART_ALL, f"{what} after rank {done[0]} finished")
    if not w.resilient:
        return Decision(
            Action.RESTART_ALL, f"{what}; it does not recover in place (not under @resilient)"
        )
    if w.replacement and now - w.started_at < policy.settle_s:
        return Decision(
            Action.RESTART_ALL,
            f"{what}: its replacement died too, {now - w.started_at:.1f} s after it started",
        )
    if w.replacements >= policy.per_rank:
        return Decision(
            Action.RESTART_ALL, f"{what}: replaced {w.replacements} times already (at most "
            f"{policy.per_rank})",
        )  # fmt: skip
    warm = policy.spares > 0 and facts.spares_ready > 0
    if not warm:
        how = "a new process takes its place (no spare)"
    elif facts.spares_warm > 0:
        how = "a warm spare takes its place"
    else:  # still quicker than a new process, which would import all of it from the start
        how = "a spare still importing torch and DeepSpeed takes its place"
    return Decision(Action.REPLACE_ONE, f"{what}; {how}", w.local_rank, warm)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "failed"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with {code}"


def failures_left(remaining_restarts: int, replaced: int) -> int:
    """What --max-restarts still allows: its restarts left, less the replacements made."""
    return remaining_restarts - replaced
