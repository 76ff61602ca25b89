"""The agent's node-health loop: every `interval` seconds it asks each monitor (`monitors.py`,
`gpuhealth.py`) for its evidence, and when the evidence says something the last plan did not
(a new fault, a clean precheck), it asks the tainter to plan the node's taint again. Looking is
local and cheap; the API server is only asked when there is something new to say.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from diag.agent.health.monitors import Monitor
from diag.agent.taint.model import Evidence, Signal, TaintPolicy
from diag.agent.taint.planner import faults_of

log = logging.getLogger(__name__)

Plan = Callable[[Sequence[Evidence]], bool]  # True: planned (and applied, unless a dry run)


def signature(evidence: Sequence[Evidence], policy: TaintPolicy, now: float) -> frozenset[str]:
    """What the evidence says, as the planner would put it: its fault lines, and each clean
    precheck (which may clear a taint)."""
    lines = {f.line for f in faults_of(evidence, policy, now)}
    clean = {f"clean precheck at {e.at}" for e in evidence if e.signal == Signal.PRECHECK_HEALTHY}
    return frozenset(lines | clean)


def needs_plan(now_says: frozenset[str], planned: frozenset[str]) -> bool:
    """Plan again only for something the last plan did not see: a fault that went away changes
    nothing on the node (the taint stays until a clean precheck, `diag untaint` or its expiry)."""
    return bool(now_says - planned)


class HealthWatch:
    def __init__(
        self,
        monitors: Sequence[Monitor],
        policy: TaintPolicy,
        interval: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.monitors = list(monitors)
        self.policy = policy
        self.interval = interval
        self.clock = clock
        self.plans = 0
        self._evidence: tuple[Evidence, ...] = ()
        self._planned: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> tuple[Evidence, ...]:
        """The evidence of the last look (for the plans made after an incident)."""
        with self._lock:
            return self._evidence

    def look(self) -> tuple[Evidence, ...]:
        now = self.clock()
        evidence: list[Evidence] = []
        for m in self.monitors:
            try:
                evidence += m.poll(now)
            except Exception:  # one broken source must not stop the others
                log.exception("node health monitor %s failed", m.name)
        with self._lock:
            self._evidence = tuple(evidence)
        return self._evidence

    def step(self, plan: Plan) -> bool:
        """One look, and a plan when it says something new. True when it planned."""
        evidence = self.look()
        says = signature(evidence, self.policy, self.clock())
        if not needs_plan(says, self._planned):
            self._planned = says
            return False
        if plan(evidence):
            self._planned = says
            self.plans += 1
            return True
        return False  # the plan failed (the API server, the ledger): the next look tries again

    def start(self, plan: Plan) -> HealthWatch:
        for m in self.monitors:
            m.start()
        self._thread = threading.Thread(
            target=self._run, args=(plan,), name="diag-node-health", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, plan: Plan) -> None:
        while True:
            try:
                self.step(plan)
            except Exception:
                log.exception("node health check failed")
            if self._stop.wait(self.interval):
                return

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for m in self.monitors:
            m.close()
