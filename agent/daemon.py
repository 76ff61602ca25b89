"""`diag agent`: the sidecar's main loop. Observe, decide (pure core), execute, repeat.

The loop sleeps in poll() on the ranks' pidfds between checks, so a rank's death wakes it at once;
everything else is seen within one `--interval`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from dataclasses import replace
from types import FrameType

from diag.agent import config as config_mod
from diag.agent import exitcodes
from diag.agent.actions import Executor
from diag.agent.board import Board
from diag.agent.config import AgentConfig, Until
from diag.agent.culprit import SuspectKind
from diag.agent.hang import EventKind, Verdict, WatchState, decide
from diag.agent.metrics.exporter import AgentMetrics
from diag.agent.metrics.server import MetricsServer
from diag.agent.observer import Observer
from diag.agent.pyspy import can_trace

log = logging.getLogger(__name__)


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.observer = Observer(cfg.run_dir, cfg.job)
        self.executor = Executor(
            self.observer,
            cfg.timeline,
            cfg.node,
            stop_grace=cfg.stop_grace,
            native_stacks=cfg.native_stacks,
            pyspy_timeout=cfg.pyspy_timeout,
        )
        self.state = WatchState()
        self.incidents = 0
        self._stop = threading.Event()
        self.observations = 0
        self.board = (
            Board(cfg.peers_dir, cfg.node, publish_every=cfg.peer_interval)
            if cfg.peers_dir is not None
            else None
        )
        self.metrics: AgentMetrics | None = None
        if cfg.metrics_port is not None:
            self.metrics = AgentMetrics(
                cfg.node,
                cfg.policy.timeouts,
                job=cfg.job,
                xpu_timer=cfg.xpu_timer,
                precheck_file=cfg.precheck_metrics,
            )
            self.executor.listeners.append(self.metrics.on_incident)

    def request_stop(self) -> None:
        self._stop.set()

    def step(self, now: float) -> list[EventKind]:
        t0 = time.perf_counter()
        obs = self.observer.observe(now)
        self.observations += 1
        decision = decide(self.state, obs, self.cfg.policy)
        if self.board is not None:
            self.board.publish(obs, force=decision.verdict is not None)
            if decision.verdict is not None and _points_elsewhere(decision.verdict):
                # Read the other nodes' agents once, now, and decide again with their ranks in
                # view: the culprit may be named exactly instead of "on another node".
                since = min((w.since for w in decision.verdict.waits), default=float("-inf"))
                remote, groups = self.board.peers(obs, since)
                if remote:
                    obs = replace(obs, remote=tuple(remote), groups={**groups, **obs.groups})
                    decision = decide(self.state, obs, self.cfg.policy)
        self.state = decision.state
        if self.metrics is not None:
            self.metrics.update(obs, self.state, decision.verdict)
        for e in decision.events:
            level = logging.WARNING if e.kind == EventKind.INCIDENT else logging.INFO
            log.log(level, "%s: %s", e.kind.value, e.message)
        for action in decision.actions:
            self.executor.execute(action)
        if decision.verdict is not None:
            self.incidents += 1
        if self.metrics is not None:
            self.metrics.iteration_done(time.perf_counter() - t0)
        return [e.kind for e in decision.events]

    def run(self) -> int:
        cfg = self.cfg
        log.info(
            "watching %s (timeline %s, hang limit <= %gs, on hang: %s)",
            cfg.run_dir,
            cfg.timeline,
            cfg.policy.timeouts.ceiling,
            cfg.policy.on_hang.value,
        )
        if not can_trace():
            log.warning(
                "no ptrace permission: stack dumps will fail; run as root or add SYS_PTRACE"
            )
        server = self._serve_metrics()
        try:
            while not self._stop.is_set():
                kinds = self.step(time.monotonic())
                if cfg.until == Until.INCIDENT and self.incidents:
                    break
                if cfg.until == Until.JOB_END and EventKind.JOB_ENDED in kinds:
                    break
                self.observer.wait(cfg.interval)
        finally:
            self.executor.join(timeout=cfg.stop_grace + 5)
            self.observer.close()
            if server is not None:
                server.close()
            if self.metrics is not None:
                self.metrics.close()
        return exitcodes.HANG_DETECTED if self.incidents and cfg.until != Until.FOREVER else 0

    def _serve_metrics(self) -> MetricsServer | None:
        cfg = self.cfg
        if self.metrics is None or cfg.metrics_port is None:
            return None
        try:
            server = MetricsServer(self.metrics.render, cfg.metrics_host, cfg.metrics_port)
        except OSError as e:
            raise exitcodes.UsageError(
                f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {e.strerror}; "
                "choose another --metrics-port (0 picks a free one)"
            ) from e
        log.info("serving metrics on http://%s:%d/metrics", cfg.metrics_host, server.port)
        return server.start()


def _points_elsewhere(verdict: Verdict) -> bool:
    return any(s.kind == SuspectKind.REMOTE for s in verdict.suspects)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_mod.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args)
    _check_dirs(cfg)
    agent = Agent(cfg)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        agent.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return agent.run()


def _check_dirs(cfg: AgentConfig) -> None:
    try:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise exitcodes.UsageError(
            f"cannot create the run directory {cfg.run_dir}: {e.strerror}; set --run-dir or "
            "DIAG_RUN_DIR to a directory shared with the trainer"
        ) from e
    try:
        cfg.timeline.mkdir(parents=True, exist_ok=True)
        probe = cfg.timeline / ".diag-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise exitcodes.UsageError(
            f"cannot write incidents to {cfg.timeline}: {e.strerror}; set --timeline or "
            "DIAG_TIMELINE to a writable directory"
        ) from e
