"""`--on-hang recover`: after the evidence, the agent asks the live ranks to recover in place
(diag.trainer.resilient) over the control channel instead of stopping them.

One rank that takes the command is enough for the world: it posts the fault in the launcher's
store, and every rank of the job, on every node, aborts its groups and forms the next generation.
A rank that was asked and says it cannot (not under the wrapper), or does not answer within the
grace (stuck in C code with the GIL held: its control thread cannot run), is stopped as
`--on-hang stop` would stop it, and its launcher replaces it (a full restart under torchrun).
When no rank takes it, every live rank is stopped. Ranks not connected to the agent cannot be
asked; they hear of the fault through the store, or are stopped when no rank takes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from diag.agent.checkpoint.sessions import CommandKind, CommandReport

log = logging.getLogger(__name__)

REASON_MAX = 1000
# A rank's control thread answers in milliseconds whenever the GIL is free: one silent this long
# holds it (stuck in C), and every second waited here is a second the whole job waits.
ANSWER_GRACE_S = 3.0


def answer_grace(stop_grace: float) -> float:
    """How long to wait for the ranks' answers: the stop grace, at most ANSWER_GRACE_S."""
    return min(stop_grace, ANSWER_GRACE_S)


class Commands(Protocol):
    def send_command(
        self, job: str, kind: int, ranks: list[int] | None = None, **kw: object
    ) -> dict[int, str]: ...

    def wait_reports(self, ids: list[str], timeout: float) -> dict[str, CommandReport]: ...


@dataclass(frozen=True)
class Outcome:
    taken: tuple[int, ...]  # ranks recovering in place
    to_stop: tuple[int, ...]  # ranks that cannot: stopped, their launcher replaces them
    answers: tuple[tuple[int, str], ...]  # rank -> what it said (or why it is stopped)
    not_asked: tuple[int, ...] = ()  # not connected to the agent


def judge(
    ranks: tuple[int, ...], sent: Mapping[int, str], reports: Mapping[str, CommandReport]
) -> Outcome:
    """Which ranks recover and which are stopped, from the commands sent and the answers."""
    taken, silent, refused, unasked, answers = [], [], [], [], []
    for rank in ranks:
        cid = sent.get(rank)
        report = reports.get(cid) if cid else None
        if cid is None:
            unasked.append(rank)
            answers.append((rank, "not connected to the agent: not asked"))
        elif report is None:
            silent.append(rank)
            answers.append((rank, "no answer within the grace (stuck in native code?)"))
        elif report.ok:
            taken.append(rank)
            answers.append((rank, report.detail or "recovering in place"))
        else:
            refused.append(rank)
            answers.append((rank, report.detail or "cannot recover in place"))
    # Nobody took it, so nobody posts the fault: every rank stopped (the launcher's restart).
    stop = tuple(sorted(silent + refused)) if taken else ranks
    return Outcome(tuple(taken), stop, tuple(answers), tuple(unasked))


def ask_to_recover(
    commands: Commands,
    job: str,
    ranks: tuple[int, ...],
    reason: str,
    verdict_time: float,
    grace: float,
) -> Outcome:
    """Sends RECOVER to the connected ranks among `ranks` and waits up to `grace` seconds for
    their answers (blocking: run it off the watch loop)."""
    t0 = time.monotonic()
    sent = commands.send_command(
        job, CommandKind.RECOVER, list(ranks), reason=reason[:REASON_MAX],
        verdict_time=verdict_time,
    )  # fmt: skip
    reports = commands.wait_reports(list(sent.values()), grace) if sent else {}
    outcome = judge(ranks, sent, reports)
    for rank, said in outcome.answers:
        log.warning("recover in place: rank %d: %s", rank, said)
    log.warning(
        "recover in place: %d of %d ranks took it in %.2f s%s",
        len(outcome.taken), len(ranks), time.monotonic() - t0,
        f"; stopping ranks {list(outcome.to_stop)}" if outcome.to_stop else "",
    )  # fmt: skip
    return outcome
