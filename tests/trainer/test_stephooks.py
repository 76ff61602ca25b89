"""The one patch of `engine.step`: its order, idempotence and exceptions, on real objects with a
step method. The reference is what the hooks did before they shared a patch: each registration
wrapped `step` itself, the newest outermost."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from diag.trainer.stephooks import StepHook, add_step_hook, remove_step_hook, step_hooks


class Engine:
    """The parts of a DeepSpeed engine the hooks use: a step that advances `global_steps`."""

    def __init__(self, events: list[str], fail_step: bool = False) -> None:
        self.events = events
        self.global_steps = 0
        self.fail_step = fail_step

    def step(self, lr_kwargs: Any = None) -> str:
        self.events.append("step")
        if self.fail_step:
            raise RuntimeError("step failed")
        self.global_steps += 1
        return f"stepped {self.global_steps} {lr_kwargs}"


class ModuleEngine(torch.nn.Module):
    """A DeepSpeed engine is a torch module: setting and deleting `step` goes through
    Module.__setattr__ and __delattr__."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.global_steps = 0

    def step(self) -> int:
        self.global_steps += 1
        return self.global_steps


class Boom(Exception):
    pass


def recorder(events: list[str], name: str, fail: str = "") -> StepHook:
    """A hook named `name` with a before and an after that log themselves; `fail` ("before" or
    "after") raises there after logging."""

    def at(where: str) -> Callable[[Any], None]:
        def hook(engine: Any) -> None:
            events.append(f"{name}.{where}")
            if fail == where:
                raise Boom(f"{name}.{where}")

        return hook

    return StepHook(name, before=at("before"), after=at("after"))


def nested_reference(engine: Engine, hooks: list[StepHook]) -> None:
    """Each hook wrapping `engine.step` on its own, as attach, FlashCheckpointer and graceful_exit
    did before."""
    for h in hooks:
        orig = engine.step

        def step(*args: Any, _orig: Any = orig, _h: StepHook = h, **kwargs: Any) -> Any:
            if _h.before is not None:
                _h.before(engine)
            result = _orig(*args, **kwargs)
            if _h.after is not None:
                _h.after(engine)
            return result

        engine.step = step  # type: ignore[method-assign]


def run_step(engine: Engine) -> tuple[str, ...]:
    try:
        return ("returned", engine.step(lr_kwargs={"lr": 1}))
    except Boom as e:
        return ("raised", str(e))
    except RuntimeError as e:
        return ("raised", str(e))


NAMES = ("journal", "flash", "graceful")
FAILURES = [("", "", False)] + [
    (name, where, False) for name in NAMES for where in ("before", "after")
]
FAILURES.append(("", "", True))  # the step itself raises


@pytest.mark.parametrize("order", list(itertools.permutations(NAMES)))
@pytest.mark.parametrize(("failing", "where", "fail_step"), FAILURES)
def test_every_registration_order_and_failure_runs_as_nested_wrappers_did(
    order: tuple[str, ...], failing: str, where: str, fail_step: bool
) -> None:
    outcomes = []
    for install in (nested_reference, "stephooks"):
        events: list[str] = []
        engine = Engine(events, fail_step=fail_step)
        hooks = [recorder(events, n, where if n == failing else "") for n in order]
        if install == "stephooks":
            for h in hooks:
                add_step_hook(engine, h)
        else:
            nested_reference(engine, hooks)
        result = run_step(engine)
        outcomes.append((events, result, engine.global_steps))
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][0]  # the step ran or something before it did


def test_the_documented_order_for_attach_then_flash_then_graceful() -> None:
    events: list[str] = []
    engine = Engine(events)
    add_step_hook(engine, StepHook("journal", after=lambda e: events.append("journal")))
    add_step_hook(
        engine,
        StepHook(
            "flash",
            before=lambda e: events.append("flash.wait"),
            after=lambda e: events.append("flash.boundary"),
        ),
    )
    add_step_hook(engine, StepHook("graceful", after=lambda e: events.append("graceful")))
    assert engine.step() == "stepped 1 None"
    assert events == ["flash.wait", "step", "journal", "flash.boundary", "graceful"]
    assert [h.owner for h in step_hooks(engine)] == ["journal", "flash", "graceful"]


def test_hooks_see_the_stepped_engine_and_the_arguments_reach_the_step() -> None:
    events: list[str] = []
    engine = Engine(events)
    seen: list[tuple[str, int]] = []
    add_step_hook(
        engine,
        StepHook(
            "counter",
            before=lambda e: seen.append(("before", e.global_steps)),
            after=lambda e: seen.append(("after", e.global_steps)),
        ),
    )
    assert engine.step({"lr": 0.5}) == "stepped 1 {'lr': 0.5}"
    assert engine.step(lr_kwargs=None) == "stepped 2 None"
    assert seen == [("before", 0), ("after", 1), ("before", 1), ("after", 2)]


class Owner:
    """An owner registering bound methods, as the trainer's classes do."""

    def __init__(self, engine: Engine) -> None:
        self.calls = 0
        self.hook = StepHook("owner", after=self.after)
        add_step_hook(engine, self.hook)

    def after(self, engine: Any) -> None:
        self.calls += 1


def test_registering_twice_wraps_once_and_runs_once() -> None:
    events: list[str] = []
    engine = Engine(events)
    owner = Owner(engine)
    wrapper = engine.step
    again = add_step_hook(engine, StepHook("owner", after=owner.after))  # equal: not added
    assert engine.step is wrapper
    assert again == owner.hook and len(step_hooks(engine)) == 1
    engine.step()
    assert events == ["step"] and owner.calls == 1

    second = Owner(engine)  # another owner: its own registration, the same patch
    assert engine.step is wrapper and len(step_hooks(engine)) == 2
    engine.step()
    assert events == ["step", "step"] and owner.calls == 2 and second.calls == 1


def test_removing_a_hook_stops_it_and_the_last_puts_step_back() -> None:
    events: list[str] = []
    engine = Engine(events)
    a, b = recorder(events, "a"), recorder(events, "b")
    add_step_hook(engine, a)
    add_step_hook(engine, b)
    assert remove_step_hook(engine, a)
    assert not remove_step_hook(engine, a)  # already gone
    engine.step()
    assert events == ["b.before", "step", "b.after"]
    assert remove_step_hook(engine, b)
    assert "step" not in vars(engine) and step_hooks(engine) == ()
    assert engine.step.__func__ is Engine.step  # type: ignore[attr-defined]
    events.clear()
    engine.step()
    assert events == ["step"]
    add_step_hook(engine, a)  # and a new registration patches it again
    engine.step()
    assert events == ["step", "a.before", "step", "a.after"]


def test_a_hook_added_or_removed_during_a_step_counts_from_the_next() -> None:
    events: list[str] = []
    engine = Engine(events)
    late = recorder(events, "late")

    def add_late(e: Any) -> None:
        events.append("adder")
        add_step_hook(e, late)

    adder = StepHook("adder", after=add_late)
    add_step_hook(engine, adder)
    engine.step()
    assert events == ["step", "adder"]
    events.clear()
    remove_step_hook(engine, adder)
    engine.step()
    assert events == ["late.before", "step", "late.after"]


def test_a_step_replaced_on_top_of_the_patch_is_left_alone() -> None:
    events: list[str] = []
    engine = Engine(events)
    a = recorder(events, "a")
    add_step_hook(engine, a)
    patched = engine.step

    def outer(*args: Any, **kwargs: Any) -> Any:
        events.append("outer")
        return patched(*args, **kwargs)

    engine.step = outer  # type: ignore[method-assign]
    b = recorder(events, "b")
    add_step_hook(engine, b)
    assert engine.step is outer
    engine.step()
    assert events == ["outer", "b.before", "a.before", "step", "a.after", "b.after"]
    remove_step_hook(engine, a)
    remove_step_hook(engine, b)
    assert engine.step is outer  # not ours to put back


def test_a_torch_module_engine_is_patched_and_restored() -> None:
    engine = ModuleEngine()
    steps: list[int] = []
    hook = add_step_hook(engine, StepHook("count", after=lambda e: steps.append(e.global_steps)))
    assert engine.step() == 1 and engine.step() == 2
    assert steps == [1, 2]
    remove_step_hook(engine, hook)
    assert "step" not in vars(engine)
    assert engine.step() == 3 and steps == [1, 2]
    assert [n for n, _ in engine.named_parameters()] == ["lin.weight", "lin.bias"]


def test_an_object_without_a_step_method_is_refused_with_a_clear_error() -> None:
    with pytest.raises(TypeError, match="has no step method to hook"):
        add_step_hook(object(), StepHook("journal"))
