"""The agent's start-up, in the order that keeps privilege where it is needed:

1. decide who the agent becomes (privilege.stance);
2. as root, when it drops: its own state directory (a directory only root enters, holding one
   of the ranks' user's), the metrics port, the Kubernetes client, the modules it would import
   later, and the root dump helper; then it becomes the ranks' user;
3. as whoever it is now: the lock of its run directory, the run directory and the timeline
   judged and probed, the replica store placed in the state directory.

Everything after step 2 happens with the privileges of the user whose directories it touches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import replace
from types import TracebackType
from typing import Any

from diag.agent.config.agentconfig import AgentSettings
from diag.agent.evidence.pyspy import Launcher
from diag.agent.metrics.server import bind_listener
from diag.agent.observe.rundircheck import prepare as prepare_run_dir
from diag.agent.privilege import drop, statedir
from diag.agent.privilege.helperspy import DumpHelper, HelperLauncher
from diag.agent.privilege.stance import PrivilegePlan, plan
from diag.agent.taint.kube import connect
from diag.agent.taint.taintconfig import TaintMode
from diag.formats import exitcodes
from diag.formats.incidentdir import probe_timeline
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)


class AgentStart:
    """What the agent holds from start-up to exit: entered before the Agent is built."""

    def __init__(self, cfg: AgentSettings) -> None:
        self.cfg = cfg
        self.started_as_root = os.geteuid() == 0
        uid = cfg.trainer.uid
        account = drop.account_of(uid) if uid else None
        self.plan: PrivilegePlan = plan(os.geteuid(), uid, cfg.trainer.gid, account)
        self.owners = Owners.this_process()
        self.launcher: Launcher | None = None
        self.metrics_listener: socket.socket | None = None
        self.kube_api: Any = None
        self._helper: DumpHelper | None = None
        self._state: statedir.StateDir | None = None
        self._lock: int | None = None

    def __enter__(self) -> AgentStart:
        try:
            self._start()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def _start(self) -> None:
        cfg = self.cfg
        euid = os.geteuid()
        state = statedir.open_state_dir(cfg.state_dir or statedir.default_state_dir(euid), euid)
        self._state = state
        become = self.plan.become
        if become is not None:
            self._state = statedir.open_dropped(state, become.uid, become.gid)
            state.close()  # the root directory above it: not needed once inside
            self._before_drop()
            self._helper = DumpHelper.start(become.uid)
            self.launcher = HelperLauncher(self._helper)
            drop.become(become)
        log.info("%s", self.plan.describe())
        self._lock = self._state.lock(cfg.run_dir)
        self.owners = _check_dirs(cfg, self.started_as_root)
        if cfg.replica is not None and cfg.replica.directory is None:
            key = statedir.run_dir_key(cfg.run_dir)
            where = self._state.path / f"replicas-{key}"
            self.cfg = replace(cfg, replica=replace(cfg.replica, directory=where))

    def _before_drop(self) -> None:
        """What needs root, or what root alone may read: done once, kept."""
        cfg = self.cfg
        if cfg.metrics_port is not None:
            try:
                self.metrics_listener = bind_listener(cfg.metrics_host, cfg.metrics_port)
            except OSError as e:
                raise exitcodes.UsageError(
                    f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: "
                    f"{e.strerror}; choose another --metrics-port (0 picks a free one)"
                ) from e
        taints = cfg.taint.mode != TaintMode.OFF
        drop.preload(kubernetes=taints)
        if taints:
            try:
                self.kube_api = connect(cfg.taint.kubeconfig)
            except exitcodes.UsageError as e:
                # As before a drop: reported at each taint, which then fails.
                log.warning("%s", e)

    def _close(self) -> None:
        if self._helper is not None:
            self._helper.close()
            self._helper = None
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock)
            self._lock = None
        if self._state is not None:
            self._state.close()
            self._state = None


def _check_dirs(cfg: AgentSettings, started_as_root: bool) -> Owners:
    """The run directory made (private) or judged: whose files in it the agent believes."""
    owners = prepare_run_dir(cfg.run_dir, cfg.trainer, started_as_root=started_as_root)
    try:
        probe_timeline(cfg.timeline)
    except OSError as e:
        raise exitcodes.UsageError(
            f"cannot write incidents to {cfg.timeline} as uid {os.geteuid()}: {e.strerror}; set "
            "--timeline or DIAG_TIMELINE to a directory this user can write"
        ) from e
    return owners
