"""diag launch's worker policy (diag.launch.workerpolicy), table-driven with plain numbers for
time: when a dead worker is replaced alone, when every worker restarts as under torchrun, when
the launch fails or is done, and why."""

from __future__ import annotations

import pytest

from diag.launch.workerpolicy import Action, Decision, Facts, Policy, State, Worker, decide

RUN, OK, DEAD = State.RUNNING, State.SUCCEEDED, State.FAILED
NOW = 1000.0


def w(rank: int, state: State = RUN, code: int | None = None, **kw: object) -> Worker:
    return Worker(rank, rank, state, code, **kw)  # type: ignore[arg-type]


def facts(*workers: Worker, left: int = 3, spares: int = 1) -> Facts:
    return Facts(tuple(workers), left, spares, spares)  # every spare done importing


KILLED = w(1, DEAD, -9, resilient=True, started_at=0.0)


@pytest.mark.parametrize(
    ("policy", "f", "action", "reason"),
    [
        (Policy(), facts(w(0), w(1)), Action.CONTINUE, ""),
        (Policy(), facts(w(0, OK, 0), w(1)), Action.CONTINUE, ""),  # torchrun waits for all
        (Policy(), facts(w(0, OK, 0), w(1, OK, 0)), Action.DONE, "every worker exited 0"),
        (Policy(), facts(w(0), KILLED), Action.REPLACE_ONE, "a warm spare takes its place"),
        (
            Policy(), facts(w(0), KILLED, spares=0), Action.REPLACE_ONE,
            "a new process takes its place (no spare)",
        ),
        (Policy(spares=0), facts(w(0), KILLED), Action.REPLACE_ONE, "no spare"),
        (
            Policy(), facts(w(0), w(1, DEAD, 1)), Action.RESTART_ALL,
            "rank 1 exited with 1; it does not recover in place (not under @resilient)",
        ),
        (
            Policy(), facts(w(0, DEAD, 1, resilient=True), KILLED), Action.RESTART_ALL,
            "more than one worker failed at once",
        ),
        (Policy(), facts(w(0, OK, 0), KILLED), Action.RESTART_ALL, "after rank 0 finished"),
        (
            Policy(settle_s=60),
            facts(w(0), w(1, DEAD, -9, resilient=True, replacement=True, started_at=NOW - 5)),
            Action.RESTART_ALL, "its replacement died too, 5.0 s after it started",
        ),
        (
            Policy(settle_s=60),
            facts(w(0), w(1, DEAD, -9, resilient=True, replacement=True, started_at=NOW - 61,
                        replacements=1)),
            Action.REPLACE_ONE, "a warm spare",
        ),
        (
            Policy(per_rank=2),
            facts(w(0), w(1, DEAD, -9, resilient=True, replacement=True, started_at=0.0,
                        replacements=2)),
            Action.RESTART_ALL, "replaced 2 times already (at most 2)",
        ),
        (
            Policy(), facts(w(0), KILLED, left=0), Action.FAIL,
            "rank 1 was killed by signal 9; no restarts left (--max-restarts)",
        ),
        (Policy(), facts(w(0), w(1, DEAD, 1), left=0), Action.FAIL, "no restarts left"),
    ],
)  # fmt: skip
def test_the_policy_decides_with_its_reason(
    policy: Policy, f: Facts, action: Action, reason: str
) -> None:
    d = decide(policy, f, NOW)
    assert d.action is action, d
    assert reason in d.reason, d


def test_a_replacement_names_the_dead_workers_local_rank_and_whether_a_spare_takes_it() -> None:
    f = facts(w(0), Worker(2, 5, DEAD, -9, resilient=True), w(1))
    assert decide(Policy(), f, NOW) == Decision(
        Action.REPLACE_ONE, "rank 5 was killed by signal 9; a warm spare takes its place", 2, True
    )
    cold = decide(Policy(spares=0), f, NOW)
    assert (cold.local_rank, cold.warm) == (2, False)


def test_a_spare_still_importing_takes_the_place_and_the_reason_says_so() -> None:
    dead = Worker(2, 5, DEAD, -9, resilient=True)
    importing = Facts((w(0), dead, w(1)), failures_left=3, spares_ready=1, spares_warm=0)
    d = decide(Policy(), importing, NOW)
    assert (d.action, d.local_rank, d.warm) == (Action.REPLACE_ONE, 2, True)
    assert d.reason.endswith("a spare still importing torch and DeepSpeed takes its place")
    warm = Facts((w(0), dead, w(1)), failures_left=3, spares_ready=1, spares_warm=1)
    assert decide(Policy(), warm, NOW).reason.endswith("a warm spare takes its place")
