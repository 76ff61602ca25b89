"""The rank processes that registered over the control channel, watched through pidfds.

A rank that only uses the flash checkpointer (no `attach`, so no op journal) is known to the agent
by its registration: its PID, start time and PID namespace. That is enough to watch it. While it
registers the process is alive (it is the caller), so the PID is checked to name that very
process, a pidfd is opened on it, and a thread of its own sleeps in poll() on all the pidfds,
waking the moment one of them exits, whatever the agent's main loop is doing.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass

from diag.agent.observe.procs import same_process
from diag.formats.rundir import pid_namespace

log = logging.getLogger(__name__)


class WatchOutcome(enum.Enum):
    WATCHED = "watched"
    GONE = "gone"  # ended before it could be watched: reported as an exit all the same
    INVISIBLE = "invisible"  # another PID namespace, or not verifiable: cannot be watched


@dataclass(frozen=True)
class Writer:
    pid: int
    start_time: float  # psutil-style create time, 0 if the client did not say
    label: str  # for logs: "rank 1 of job x"


ExitHandler = Callable[[Writer], None]


class WriterWatch:
    def __init__(self, on_exit: ExitHandler, own_pid_ns: int | None = None) -> None:
        self._on_exit = on_exit
        self._own_ns = pid_namespace() if own_pid_ns is None else own_pid_ns
        self._lock = threading.Lock()
        self._watched: dict[int, Writer] = {}  # pid -> writer
        self._inbox: queue.SimpleQueue[tuple[int, Writer] | None] = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="diag-writers", daemon=True)
        self._thread.start()

    def watch(self, pid: int, start_time: float, pid_ns: int, label: str) -> WatchOutcome:
        """Starts watching a registering process (again after a reconnect: a no-op). Runs on the
        caller's thread while the process waits for its answer."""
        if pid <= 0 or (pid_ns and pid_ns != self._own_ns):
            return WatchOutcome.INVISIBLE
        ours = pid_ns == self._own_ns  # its PIDs are ours: one we cannot find is gone
        writer = Writer(pid, start_time, label)
        with self._lock:
            known = self._watched.get(pid)
            if known is not None and known.start_time == start_time:
                return WatchOutcome.WATCHED
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return self._gone(writer) if ours else WatchOutcome.INVISIBLE
        except OSError as e:  # pidfds unsupported (Linux < 5.3), or not permitted
            log.debug("cannot open a pidfd for pid %d: %s", pid, e)
            return WatchOutcome.INVISIBLE
        # The pidfd names whatever process had the PID when it was opened: the start time
        # tells whether that was the caller (a PID reused in between would differ).
        if start_time and not same_process(pid, start_time):
            os.close(fd)
            return self._gone(writer) if ours else WatchOutcome.INVISIBLE
        if not start_time and not ours:
            os.close(fd)  # an older client: nothing to tell its process from another
            return WatchOutcome.INVISIBLE
        with self._lock:
            self._watched[pid] = writer
        if not self._post((fd, writer)):
            os.close(fd)
            return WatchOutcome.INVISIBLE
        return WatchOutcome.WATCHED

    def _gone(self, writer: Writer) -> WatchOutcome:
        self._post((-1, writer))
        return WatchOutcome.GONE

    def _post(self, item: tuple[int, Writer] | None) -> bool:
        """Hands an item to the watch's thread; False once the watch is closed."""
        with self._lock:
            if self._closed:
                return False
            if item is None:
                self._closed = True
            self._inbox.put(item)
            os.eventfd_write(self._wake, 1)
            return True

    def watched(self) -> list[Writer]:
        with self._lock:
            return list(self._watched.values())

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        fds: dict[int, Writer] = {}
        try:
            while True:
                exited: list[Writer] = []
                for fd, _ in poller.poll():
                    if fd == self._wake:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(self._wake)
                        while True:
                            try:
                                item = self._inbox.get_nowait()
                            except queue.Empty:
                                break
                            if item is None:
                                return
                            new_fd, writer = item
                            if new_fd < 0:
                                exited.append(writer)
                            else:
                                fds[new_fd] = writer
                                poller.register(new_fd, select.POLLIN)
                        continue
                    writer = fds.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    exited.append(writer)
                for writer in exited:
                    with self._lock:
                        if self._watched.get(writer.pid) == writer:
                            del self._watched[writer.pid]
                    try:
                        self._on_exit(writer)
                    except Exception:
                        log.exception("handling the exit of %s failed", writer.label)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self, timeout: float = 5.0) -> None:
        """Stops the watch; an exit being handled finishes first (up to `timeout` seconds)."""
        if not self._post(None):
            return
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._wake)
