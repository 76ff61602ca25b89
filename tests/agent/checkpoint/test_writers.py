"""The agent's watch of registered rank processes, on real processes: a death wakes it at once, a
process already gone (or a PID that now names another process) counts as an exit, and a process
of another PID namespace is never watched (its PID means something else here)."""

from __future__ import annotations

import queue
import subprocess
import sys
import time

import psutil
import pytest

from diag.agent.checkpoint.writers import WatchOutcome, Writer, WriterWatch
from diag.formats.rundir import pid_namespace

pytestmark = pytest.mark.timeout(60)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_death_wakes_the_watch_and_gone_processes_count_as_exits() -> None:
    exits: queue.Queue[tuple[Writer, float]] = queue.Queue()
    watch = WriterWatch(lambda w: exits.put((w, time.monotonic())))
    ns = pid_namespace()
    live, quick = _sleeper(), _sleeper()
    try:
        start = psutil.Process(live.pid).create_time()
        assert watch.watch(live.pid, start, ns, "rank 0 of j") == WatchOutcome.WATCHED
        assert watch.watch(live.pid, start, ns, "rank 0 of j") == WatchOutcome.WATCHED  # again
        assert [w.pid for w in watch.watched()] == [live.pid]
        # A PID that names another process than the one that registered (reused): gone.
        wrong = watch.watch(quick.pid, start - 100.0, ns, "rank 1 of j")
        assert wrong == WatchOutcome.GONE
        w, _ = exits.get(timeout=5)
        assert (w.pid, w.label) == (quick.pid, "rank 1 of j")
        # Already gone when it registers (killed right after calling): gone.
        quick_start = psutil.Process(quick.pid).create_time()
        quick.kill()
        quick.wait(10)
        assert watch.watch(quick.pid, quick_start, ns, "rank 1 of j") == WatchOutcome.GONE
        assert exits.get(timeout=5)[0].pid == quick.pid

        killed_at = time.monotonic()
        live.kill()
        w, seen_at = exits.get(timeout=5)
        assert w.pid == live.pid and w.label == "rank 0 of j"
        assert seen_at - killed_at < 2.0  # woken by the pidfd, not found by a periodic scan
        assert watch.watched() == []
    finally:
        for p in (live, quick):
            p.kill()
            p.wait(10)
        watch.close()


def test_a_process_of_another_pid_namespace_is_not_watched() -> None:
    exits: queue.Queue[Writer] = queue.Queue()
    watch = WriterWatch(exits.put)
    code = "import os, psutil, time; print(os.getpid(), psutil.Process().create_time(), "
    code += "os.stat('/proc/self/ns/pid').st_ino, flush=True); time.sleep(60)"
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        pid, start, ns = proc.stdout.readline().split()
        assert int(pid) == 1 and int(ns) != pid_namespace()
        # PID 1 here is our init: never to be taken for the rank, alive or dead.
        outcome = watch.watch(int(pid), float(start), int(ns), "rank 0 of j")
        assert outcome == WatchOutcome.INVISIBLE
        assert watch.watched() == []
        with pytest.raises(queue.Empty):
            exits.get(timeout=0.5)
    finally:
        proc.kill()
        proc.wait(10)
        watch.close()
