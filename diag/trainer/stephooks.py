"""One patch of a DeepSpeed engine's `step`, shared by everything diag runs around it.

`attach` (the journal's step boundaries), `FlashCheckpointer` (waiting for a save's copy, agent
commands) and `graceful_exit` (agreements, the drain) each register a `StepHook` here; the engine's
`step` is replaced once, on the first registration, by a wrapper that runs them.

The order is that of nested wrappers, each registration wrapping the ones before it:

    before hooks, newest registration first
    the engine's own step
    after hooks, oldest registration first
    the step's return value is returned

So with `attach(engine)`, then `FlashCheckpointer(engine, ...)`, then `graceful_exit(engine, ...)`:
the checkpointer waits for its copy, the engine steps, the journal records the step, the
checkpointer honours agent commands, the drain agrees and may leave. Called in another order, the
hooks run in that other order, as they would if each had wrapped `step` itself.

An exception ends the step where it is raised and propagates: from a before hook, the older
registrations' before hooks, the step and every after hook are skipped; from the step, every after
hook is skipped; from an after hook, the newer registrations' after hooks are skipped.

Registering an equal hook twice adds it once; removing the last hook puts the engine's `step` back
as it was. Something that replaces `engine.step` after the first registration owns it from then
on: the hooks, including those registered later, run only when it calls the step it replaced.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

HOOKS_ATTR = "_diag_step_hooks"

Hook = Callable[[Any], None]  # called with the engine


@dataclass(frozen=True)
class StepHook:
    """What one owner runs around `engine.step`. Equal hooks (the same owner name and the same
    callables: bound methods of one object compare equal) are registered once."""

    owner: str  # names the registration in logs and errors
    before: Hook | None = None
    after: Hook | None = None


class _StepChain:
    """The hooks of one engine and the `step` they wrap."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.original = engine.step
        # Whether `step` was the engine's own attribute (not its class's) before the patch.
        self.had_own = "step" in vars(engine)
        self.hooks: tuple[StepHook, ...] = ()
        self.wrapper = self._make_wrapper()

    def _make_wrapper(self) -> Callable[..., Any]:
        chain = self

        def step(*args: Any, **kwargs: Any) -> Any:
            hooks = chain.hooks  # a hook added or removed during this step counts from the next
            engine = chain.engine
            for h in reversed(hooks):
                if h.before is not None:
                    h.before(engine)
            result = chain.original(*args, **kwargs)
            for h in hooks:
                if h.after is not None:
                    h.after(engine)
            return result

        step._diag_step_chain = chain  # type: ignore[attr-defined]
        step.__wrapped__ = self.original  # type: ignore[attr-defined]
        return step

    def installed(self) -> bool:
        return vars(self.engine).get("step") is self.wrapper

    def restore(self) -> None:
        """Puts back the engine's own `step`, unless something has replaced the wrapper since."""
        if not self.installed():
            return
        if self.had_own:
            self.engine.step = self.original
        else:
            delattr(self.engine, "step")


_lock = threading.Lock()


def add_step_hook(engine: Any, hook: StepHook) -> StepHook:
    """Runs `hook` around every `engine.step()` from now on, after the hooks registered before it
    (see the module's docstring for the order). Returns `hook`, the handle to remove it with."""
    if not callable(getattr(engine, "step", None)):
        raise TypeError(f"{type(engine).__name__} has no step method to hook ({hook.owner})")
    with _lock:
        chain: _StepChain | None = getattr(engine, HOOKS_ATTR, None)
        if chain is None:
            chain = _StepChain(engine)
            setattr(engine, HOOKS_ATTR, chain)
            engine.step = chain.wrapper
        if hook in chain.hooks:
            return hook
        chain.hooks = (*chain.hooks, hook)
        log.debug("diag: step hook %s added (%d in all)", hook.owner, len(chain.hooks))
        return hook


def remove_step_hook(engine: Any, hook: StepHook) -> bool:
    """Stops running `hook`; the last one removed puts `engine.step` back. Returns False when it
    was not registered."""
    with _lock:
        chain: _StepChain | None = getattr(engine, HOOKS_ATTR, None)
        if chain is None or hook not in chain.hooks:
            return False
        chain.hooks = tuple(h for h in chain.hooks if h != hook)
        if not chain.hooks and chain.installed():
            chain.restore()
            delattr(engine, HOOKS_ATTR)
        return True


def step_hooks(engine: Any) -> tuple[StepHook, ...]:
    """The hooks registered on `engine`, oldest first."""
    chain: _StepChain | None = getattr(engine, HOOKS_ATTR, None)
    return chain.hooks if chain is not None else ()
