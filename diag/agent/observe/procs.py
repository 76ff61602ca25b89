"""The rank processes as the kernel sees them: alive or not, since when, in which state.

Deaths are noticed through pidfds (Linux >= 5.3): the agent's loop sleeps in poll() on them and
wakes the moment a rank exits, so it knows which rank died first even when the launcher tears the
others down a few milliseconds later. A PID is matched with its start time so that a reused PID
is never taken for the rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from dataclasses import dataclass

import psutil

from diag.agent.observe.idleness import Idleness

log = logging.getLogger(__name__)

_START_TIME_SLACK = 0.05  # psutil rounds create_time to 10 ms ticks


@dataclass
class ProcInfo:
    pid: int
    visible: bool  # False when this agent cannot see the PID (no shared PID namespace)
    exited_at: float | None = None
    state: str = ""
    cpu_busy: float = 0.0
    # Since when the process has been idle all along (idleness.py; not in D state or running
    # either); None: it was active at the last look, or is not known yet.
    idle_since: float | None = None


class ProcessWatch:
    def __init__(self) -> None:
        self._poll = select.poll()
        self._fds: dict[int, int] = {}  # fd -> pid
        self._info: dict[int, ProcInfo] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._cpu: dict[int, tuple[float, float, float]] = {}
        self._idle = Idleness()

    def watch(self, pid: int, start_time: float) -> ProcInfo:
        info = self._info.get(pid)
        if info is not None:
            return info
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - start_time) > _START_TIME_SLACK:
                raise psutil.NoSuchProcess(pid)  # the PID now belongs to someone else
        except psutil.NoSuchProcess:
            info = ProcInfo(pid, visible=False)
            self._info[pid] = info
            return info
        except psutil.AccessDenied:
            info = ProcInfo(pid, visible=False)
            self._info[pid] = info
            return info
        info = ProcInfo(pid, visible=True)
        self._info[pid] = info
        self._procs[pid] = proc
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            fd = -1  # pidfds unsupported: deaths are found by the periodic check instead
        if fd >= 0:
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
        return info

    def unseen(self, pid: int) -> ProcInfo:
        """A PID not looked at: in another namespace, gone, or not shown to be the rank."""
        info = self._info.get(pid)
        if info is None:
            info = self._info[pid] = ProcInfo(pid, visible=False)
        return info

    def forget(self, pid: int) -> None:
        for fd, p in list(self._fds.items()):
            if p == pid:
                self._poll.unregister(fd)
                os.close(fd)
                del self._fds[fd]
        self._info.pop(pid, None)
        self._procs.pop(pid, None)
        self._cpu.pop(pid, None)
        self._idle.forget(pid)

    def wait(self, timeout: float) -> list[int]:
        """Sleeps up to `timeout` seconds or until a watched process exits; returns the PIDs that
        exited, each stamped with the monotonic time of the wake-up."""
        if not self._fds:
            time.sleep(max(timeout, 0))
            return self._check_all()
        events = self._poll.poll(max(timeout, 0) * 1000)
        now = time.monotonic()
        dead = []
        for fd, _ in events:
            pid = self._fds.pop(fd, None)
            if pid is None:
                continue
            self._poll.unregister(fd)
            os.close(fd)
            info = self._info.get(pid)
            if info is not None and info.exited_at is None:
                info.exited_at = now
                dead.append(pid)
        return dead + self._check_all()

    def _check_all(self) -> list[int]:
        dead = []
        now = time.monotonic()
        for pid, info in self._info.items():
            if not info.visible or info.exited_at is not None:
                continue
            proc = self._procs.get(pid)
            try:
                gone = proc is None or not proc.is_running() or proc.status() == "zombie"
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                info.exited_at = now
                dead.append(pid)
        return dead

    def info(self, pid: int) -> ProcInfo | None:
        """What is known of a watched process, without looking again."""
        return self._info.get(pid)

    def refresh(self, pid: int, now: float) -> ProcInfo | None:
        """Updates the /proc state and CPU share of a live process."""
        info = self._info.get(pid)
        if info is None or not info.visible or info.exited_at is not None:
            return info
        info.state = proc_state(pid)
        if info.state in ("Z", "X", ""):
            info.exited_at = info.exited_at or now
            return info
        proc = self._procs[pid]
        try:
            t = proc.cpu_times()
            used = t.user + t.system
        except psutil.NoSuchProcess:
            info.exited_at = now
            return info
        runnable = main_thread_runnable_seconds(pid)
        prev = self._cpu.get(pid)
        self._cpu[pid] = (now, used, runnable)
        if prev is not None and now > prev[0]:
            share = (used - prev[1]) / (now - prev[0])
            # A thread that spins while the node is oversubscribed gets a slice of a core but
            # is runnable all along: count the time it waited for a CPU as busy too.
            wanted = (runnable - prev[2]) / (now - prev[0]) if runnable >= prev[2] > 0 else 0.0
            info.cpu_busy = max(0.0, share, min(wanted, 1.0))
        # At the first look the share is unknown: the look only sets the baseline.
        active = self._idle.active(proc, now, info.cpu_busy if prev is not None else 0.0)
        if prev is None or now <= prev[0] or active or info.state in ("R", "D"):
            info.idle_since = None
        elif info.idle_since is None:
            info.idle_since = prev[0]  # idle over the whole interval since the last look
        return info

    def close(self) -> None:
        for fd in list(self._fds):
            self._poll.unregister(fd)
            os.close(fd)
        self._fds.clear()


def main_thread_runnable_seconds(pid: int) -> float:
    """Seconds the process's main thread has been on a CPU or waiting in a run queue for one
    (/proc/PID/schedstat); 0.0 where the kernel does not keep it."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            on_cpu, waiting = f.read(128).split()[:2]
        return (int(on_cpu) + int(waiting)) / 1e9
    except (OSError, ValueError):
        return 0.0


def same_process(pid: int, start_time: float) -> bool:
    """Whether `pid` is visible and still names the process started at `start_time`."""
    try:
        return abs(psutil.Process(pid).create_time() - start_time) <= _START_TIME_SLACK
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def proc_state(pid: int) -> str:
    """The state letter from /proc/PID/stat ("R", "S", "D", "Z", ...); "" when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    # The command name may contain spaces and parentheses: the state follows the last ')'.
    return raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3].decode()


def proc_state_word(pid: int) -> str:
    """e.g. "S (sleeping)", "D (disk sleep)", from /proc/PID/status."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def stop_tree(pid: int, grace: float = 10.0) -> None:
    """Stops a process and everything it started: SIGTERM to the root (a launcher like torchrun
    then stops its workers, which run in sessions of their own), SIGKILL to whatever of the tree
    is left after `grace` seconds. The tree is listed before anything is signalled, so children
    re-parented on their parent's death are not lost."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        root.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
