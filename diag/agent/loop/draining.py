"""The agent's drains: requests from signals and preemption notices are only recorded (a signal
handler must not act), and the main loop runs them one at a time.

A request that ends sooner replaces a pending one; one that comes while a drain runs tightens
its deadline; a SIGTERM during an early notice's drain makes the agent exit once that drain is
done.
"""

from __future__ import annotations

import threading
import time

from diag.agent.config.agentconfig import AgentConfig
from diag.agent.drain.executor import Drainer
from diag.agent.drain.notice import Notice, deadline_of
from diag.agent.drain.plan import DrainRequest, DrainState


class Drains:
    def __init__(self, drainer: Drainer | None, cfg: AgentConfig, stop: threading.Event) -> None:
        self.drainer = drainer
        self.cfg = cfg
        self._stop = stop
        self.drained: DrainState | None = None
        self._lock = threading.Lock()
        self._request: DrainRequest | None = None
        self._exit_after = False
        self._draining = False

    @property
    def pending(self) -> DrainRequest | None:
        return self._request

    def request(self, request: DrainRequest) -> None:
        """Asks the main loop to drain (from a signal handler or the notice watcher: it only
        records the request)."""
        with self._lock:
            if request.exit_after:
                self._exit_after = True
            if self._draining:
                if self.drainer is not None:
                    self.drainer.tighten(request)
                return
            if self._request is not None:
                if _ends_sooner(request, self._request, self.cfg):
                    self._request = request
                return
            self._request = request

    def on_notice(self, notice: Notice) -> None:
        deadline = deadline_of(notice, time.time(), time.monotonic())
        self.request(
            DrainRequest(notice.describe(), time.monotonic(), deadline=deadline, exit_after=False)
        )

    def run(self, request: DrainRequest) -> bool:
        """Runs a drain on the main loop; True when the agent should exit afterwards."""
        assert self.drainer is not None
        with self._lock:
            self._draining = True
        try:
            self.drained = self.drainer.run(request, abort=self._stop)
        finally:
            with self._lock:
                self._draining = False
                self._request = None
                exit_after = self._exit_after
        return exit_after or self._stop.is_set()

    def time_left(self) -> float:
        """Seconds left of the grace period after a drain (the kubelet SIGKILLs at its end),
        infinite without one."""
        d = self.drained
        if d is None:
            return float("inf")
        margin = self.cfg.drain.margin if self.cfg.drain else 0
        return max(0.5, d.deadline + margin - 1.0 - time.monotonic())


def _ends_sooner(a: DrainRequest, b: DrainRequest, cfg: AgentConfig) -> bool:
    grace = cfg.drain.grace if cfg.drain is not None else 0.0

    def end(r: DrainRequest) -> float:
        return r.deadline if r.deadline is not None else r.at + grace

    return end(a) < end(b)
