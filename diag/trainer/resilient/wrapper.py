"""`resilient`: the user's training function, run again in the same process after a fault.

    @diag.trainer.resilient
    def train(world):                      # world: rank, world_size, generation, recoveries
        engine = build_engine()             # deepspeed.initialize(..., dist_init_required=False)
        ckpt = diag.trainer.FlashCheckpointer(engine, "/ckpt/run1")
        start = ckpt.load() or 0            # after a fault: the newest step every rank holds
        for step in range(start + 1, total + 1): ...

    train()                                 # under torchrun: it forms the process group itself

On a fault every surviving rank aborts its process groups, keeps its process, imports and data,
closes the attempt's checkpointers (their snapshots stay in shared memory), forms the next
generation of the world under fresh keys of the launcher's store, and calls the function again;
its `load()` restores the newest step complete on every rank. The decisions are the pure core's
(trainer.resilient.recovery); this module carries them out.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from diag.trainer.attach import in_attempt, new_world
from diag.trainer.control import immediate
from diag.trainer.resilient.attempt import destroy_engines, end_attempt, forget_deepspeed_state
from diag.trainer.resilient.membership import (
    Interrupted,
    Membership,
    RecoveryError,
    WorldSpec,
    reason_text,
)
from diag.trainer.resilient.recovery import (
    Action,
    Decision,
    Failure,
    History,
    Policy,
    decide,
    recovered,
    reform_failed,
)
from diag.trainer.resilient.storekeys import JOIN_ENV
from diag.trainer.resilient.waiting import interruptible_waits

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 600.0  # collectives; the agent's verdict comes long before it on a hang
_current: Membership | None = None
_calls = 0  # `resilient` runs of this process so far: each gets its own keys in the store


@dataclass(frozen=True)
class World:
    """What the training function knows of its world in this attempt."""

    rank: int
    world_size: int
    local_rank: int
    generation: int  # 0 at launch, one more after each recovery in place
    recoveries: int
    last_fault: str  # why the previous attempt ended ("" at launch)
    last_recovery_seconds: float  # from the fault to this attempt's start (0 at launch)


def resilient(
    fn: Callable[..., T] | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    policy: Policy | None = None,
) -> Any:
    """Wraps `fn(world, *args, **kwargs)` (as a decorator, with or without options)."""

    def wrap(f: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> T:
            return _run(f, args, kwargs, backend, timeout_s, policy or Policy())

        return run

    return wrap(fn) if fn is not None else wrap


def interrupt(reason: str) -> bool:
    """A fault in the current generation, known here first (the agent's verdict over the
    control channel): every rank recovers. Thread-safe. False outside `resilient`."""
    m = _current
    if m is None:
        return False
    m.interrupt(reason)
    return True


def _on_verdict(reason: str, verdict_time: float) -> immediate.RecoverAnswer:
    """The agent's RECOVER (on the control thread)."""
    m = _current
    if m is None:
        return immediate.RecoverAnswer(False, immediate.NOT_RESILIENT)
    return immediate.RecoverAnswer(True, m.on_verdict(reason, verdict_time))


def _run(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str | None,
    timeout_s: float,
    policy: Policy,
) -> T:
    global _current, _calls
    import torch.distributed as dist

    if dist.is_initialized():
        raise RecoveryError(
            "resilient forms the process group itself: remove init_process_group (and pass "
            "dist_init_required=False to deepspeed.initialize)"
        )
    spec = WorldSpec.from_env(os.environ, backend or _default_backend(), timeout_s)
    os.environ.pop(JOIN_ENV, None)  # only this run joins a running world; a later one forms it
    member = Membership(replace(spec, call=_calls))
    _calls = member.spec.call + 1  # a replacement takes the survivors' count
    _current = member
    immediate.recover_with(_on_verdict)
    restore_waits = interruptible_waits(spec.backend)
    # A replacement starts in the survivors' generation, with as many recoveries behind it.
    history, base = History(generation=member.first_generation), member.first_generation
    fault_text = "took a dead rank's place" if spec.join else ""
    fault_at, seconds = 0.0, 0.0
    stale: list[Any] = []  # the failed attempt's engines, destroyed once the next world formed
    try:
        while True:
            forget_deepspeed_state()  # DeepSpeed's groups were another world's
            try:
                member.form(history.generation)
            except Exception as e:
                d = reform_failed(history, f"{type(e).__name__}: {e}")
                log.error("diag: %s", d.reason)
                raise RecoveryError(d.reason) from e
            new_world(history.generation)
            destroy_engines(stale)
            if fault_at:
                seconds = time.monotonic() - fault_at
            world = World(spec.rank, spec.world_size, spec.local_rank, history.generation,
                          base + len(history.recoveries), fault_text, seconds)  # fmt: skip
            d, error = _attempt(fn, world, args, kwargs, member, policy, history)
            if error is None:
                return d
            assert isinstance(d, Decision)
            if d.action is Action.RAISE:
                raise error
            fault_at = time.monotonic()
            member.post(d.reason)
            member.abort()
            stale = end_attempt(error if d.action is Action.RECOVER else None)
            if d.action is Action.GIVE_UP:
                log.error("diag: rank %d: %s", spec.rank, d.reason)
                raise RecoveryError(d.reason) from error
            log.warning("diag: rank %d recovers in place: %s (%s)", spec.rank, d.reason,
                        _short(error))  # fmt: skip
            fault_text = _fault_text(d.reason, error, member.fault_reason())
            history = recovered(history, d, fault_at)
    finally:
        restore_waits()
        immediate.recover_with(None)
        _current = None
        member.close()
        if dist.is_initialized():  # after a return (the function may have destroyed it)
            dist.destroy_process_group()


def _attempt(
    fn: Callable[..., T],
    world: World,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    member: Membership,
    policy: Policy,
    history: History,
) -> tuple[Any, BaseException | None]:
    """(the function's result, None), or (the decision on its failure, the error)."""
    error: BaseException | None = None
    try:
        try:
            with in_attempt():
                return fn(world, *args, **kwargs), None
        except BaseException as e:
            error = e
            posted, told, reason = member.begin_recovery()
    except Interrupted as e:  # the interrupt landed after the error, before the line above
        error = error or e
        posted, told, reason = member.begin_recovery()
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)) and not told:
        return _raise_decision(history, error), error
    names = ",".join(c.__name__ for c in type(error).__mro__)
    failure = Failure(names, f"{error} {reason}", posted=posted, interrupted=told)
    return decide(policy, history, failure, time.monotonic()), error


def _raise_decision(history: History, error: BaseException) -> Decision:
    return Decision(Action.RAISE, None, history.generation, type(error).__name__)


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _fault_text(decided: str, error: BaseException, posted: str) -> str:
    """Why the attempt ended, for the next: the decision, the error, and the fault as posted
    when the error does not say it (an NCCL wait ends with "communicator was aborted", the
    reason being another rank's, or the agent's)."""
    text = f"{decided}: {_short(error)}"
    if not posted or posted in str(error):
        return text
    return f"{text} ({reason_text(posted.encode())})"  # bounded: it came over a channel


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}"
