"""The pure core of in-place recovery (diag.trainer.resilient.recovery): which failures are
faults, and what a rank does after one, table-driven with plain numbers for time."""

from __future__ import annotations

import pytest

from diag.trainer.resilient.recovery import (
    Action,
    Failure,
    FaultKind,
    History,
    Policy,
    classify,
    decide,
    recovered,
    reform_failed,
)

GLOO_TIMEOUT = (
    "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for "
    "recv operation to complete"
)
GLOO_CLOSED = (
    "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6051"
)
RUNTIME = "RuntimeError,Exception,BaseException,object"
DIST = "DistBackendError,RuntimeError,Exception,BaseException,object"


@pytest.mark.parametrize(
    ("failure", "kind"),
    [
        (Failure(RUNTIME, GLOO_TIMEOUT), FaultKind.TIMED_OUT),
        (Failure(DIST, GLOO_CLOSED), FaultKind.PEER_LOST),
        (Failure(DIST, "NCCL communicator was aborted on rank 3"), FaultKind.PEER_LOST),
        (
            Failure("ValueError,Exception", "Default process group has not been initialized"),
            FaultKind.PEER_LOST,
        ),
        # The user's own errors stay theirs, whatever their text says.
        (Failure("KeyError,LookupError,Exception", "'timed out'"), None),
        (Failure("ZeroDivisionError,ArithmeticError,Exception", "division by zero"), None),
        (Failure(RUNTIME, "CUDA out of memory"), None),
        (Failure("ValueError,Exception", "bad learning rate"), None),
        # Told of a fault: whatever ended the attempt is the fault's.
        (Failure("KeyError,Exception", "x", posted=True), FaultKind.POSTED),
        (
            Failure("Interrupted,BaseException", "rank 0: timed out", interrupted=True),
            FaultKind.INTERRUPTED,
        ),
        (Failure("ValueError", "x", posted=True, interrupted=True), FaultKind.INTERRUPTED),
    ],
)
def test_classify(failure: Failure, kind: FaultKind | None) -> None:
    assert classify(failure) == kind


def test_a_fault_recovers_into_the_next_generation() -> None:
    d = decide(Policy(), History(generation=4), Failure(RUNTIME, GLOO_TIMEOUT), now=100.0)
    assert (d.action, d.fault, d.generation) == (Action.RECOVER, FaultKind.TIMED_OUT, 5)
    h = recovered(History(generation=4, recoveries=(10.0,)), d, 100.0)
    assert h == History(generation=5, recoveries=(10.0, 100.0))


def test_the_users_error_is_raised_as_without_the_wrapper() -> None:
    d = decide(Policy(), History(generation=2), Failure("KeyError,Exception", "k"), now=5.0)
    assert (d.action, d.fault, d.generation) == (Action.RAISE, None, 2)
    assert "KeyError" in d.reason


@pytest.mark.parametrize(
    ("recoveries", "now", "action"),
    [
        ((), 100.0, Action.RECOVER),
        ((10.0, 20.0), 100.0, Action.RECOVER),  # 2 of 3 in the window
        ((10.0, 20.0, 30.0), 100.0, Action.GIVE_UP),  # the budget is spent
        ((10.0, 20.0, 30.0), 1011.0, Action.RECOVER),  # the first left the window
        ((10.0, 20.0, 30.0), 1030.0, Action.RECOVER),
    ],
)
def test_the_budget_of_recoveries_in_a_window(
    recoveries: tuple[float, ...], now: float, action: Action
) -> None:
    policy = Policy(max_recoveries=3, window_s=1000.0)
    history = History(generation=len(recoveries), recoveries=recoveries)
    d = decide(policy, history, Failure(DIST, GLOO_CLOSED), now)
    assert d.action == action
    if action is Action.GIVE_UP:
        assert "full restart" in d.reason and d.generation == history.generation


def test_a_generation_that_cannot_form_is_a_full_restart() -> None:
    d = reform_failed(History(generation=3), "DistStoreError: timed out")
    assert d.action is Action.GIVE_UP and d.generation == 3
    assert "generation 3" in d.reason and "full restart" in d.reason


def test_a_posted_reason_is_bounded_and_printable() -> None:
    from diag.trainer.resilient.membership import REASON_MAX, reason_text

    assert reason_text(b"rank 1 hung") == "rank 1 hung"
    assert reason_text(b"a\x1b[2Jb\nc\xff") == "a?[2Jb?c\ufffd"
    long = reason_text(b"x" * 100_000)
    assert len(long) == REASON_MAX + len(" [cut]") and long.endswith(" [cut]")


def test_the_next_attempt_is_told_the_posted_reason_once_and_bounded() -> None:
    from diag.trainer.resilient.membership import REASON_MAX, Interrupted
    from diag.trainer.resilient.wrapper import _fault_text

    why = "the agent's verdict: hang: rank 1 is the likely culprit"
    aborted = RuntimeError("NCCL communicator was aborted on rank 0.")
    text = _fault_text("interrupted in generation 0", aborted, why)
    assert text.endswith(f"communicator was aborted on rank 0. ({why})"), text
    # An error that carries the reason already says it once.
    text = _fault_text("interrupted in generation 0", Interrupted(why), why)
    assert text.count(why) == 1, text
    assert _fault_text("timed out", aborted, "") == "timed out: RuntimeError: " + str(aborted)
    long = _fault_text("x", aborted, "\x1b" + "y" * 100_000)
    assert len(long) < REASON_MAX + 200 and "\x1b" not in long, len(long)
