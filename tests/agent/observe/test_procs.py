"""The CPU share the culprit rules read: a spinning rank on an oversubscribed node is busy, a
sleeping one idle since the first look."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from diag.agent.observe.procs import ProcessWatch, main_thread_runnable_seconds

SPIN = "import sys\nprint(flush=True)\nwhile True: pass\n"


def _spinner(cpu: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE)
    os.sched_setaffinity(p.pid, {cpu})
    return p


def _spinning(*procs: subprocess.Popen) -> None:
    # The interpreter's start reads files (not runnable while it waits on the disk): the share
    # is measured from the moment each one spins.
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == b"\n"


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no schedstat")
def test_a_spinner_sharing_its_core_is_busy_although_it_gets_half_of_it() -> None:
    cpu = min(os.sched_getaffinity(0))
    a, b, c = _spinner(cpu), _spinner(cpu), _spinner(cpu)  # three on one core: a third each
    try:
        _spinning(a, b, c)
        watch = ProcessWatch()
        watch.watch(a.pid, psutil.Process(a.pid).create_time())
        watch.refresh(a.pid, time.monotonic())
        time.sleep(1.5)
        info = watch.refresh(a.pid, time.monotonic())
        assert info is not None
        share = psutil.Process(a.pid).cpu_percent(interval=0.5) / 100
        assert share < 0.6  # it gets a slice of the core...
        assert info.cpu_busy >= 0.9  # ...but wanted all of it
        assert info.idle_since is None
    finally:
        for p in (a, b, c):
            p.kill()
            p.wait(timeout=10)
            assert p.stdout is not None
            p.stdout.close()


def test_a_sleeping_process_is_not_busy() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        watch = ProcessWatch()
        watch.watch(p.pid, psutil.Process(p.pid).create_time())
        first = time.monotonic()
        watch.refresh(p.pid, first)
        time.sleep(1.0)
        info = watch.refresh(p.pid, time.monotonic())
        assert info is not None and info.cpu_busy < 0.2
        # Idle all along since the first look: the idle rule counts from there (overdue.py).
        assert info.idle_since == first
        time.sleep(0.5)
        info = watch.refresh(p.pid, time.monotonic())
        assert info is not None and info.idle_since == first
    finally:
        p.kill()
        p.wait(timeout=10)


def test_runnable_seconds_of_a_missing_process_are_zero() -> None:
    assert main_thread_runnable_seconds(2**22 + 12345) == 0.0


# A rank waiting on its loader's queue while a worker decodes; a rank reading a shard slowly;
# a rank asleep with an idle child (a loader worker that waits too).
CHILD_SPINS = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
    "time.sleep(60)\n"
)
READS = (
    "import os, time\n"
    "fd = os.open('/dev/zero', os.O_RDONLY)\n"
    "while True:\n    os.read(fd, 65536)\n    time.sleep(0.02)\n"
)
CHILD_SLEEPS = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize(
    "code, idle",
    [(CHILD_SPINS, False), (READS, False), (CHILD_SLEEPS, True)],
    ids=["child-computes", "reads-3MB/s", "child-sleeps"],
)
def test_idle_means_no_cpu_in_the_process_or_its_children_and_no_bytes_moved(
    code: str, idle: bool
) -> None:
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        time.sleep(1.0)  # the interpreters started, the child spawned
        watch = ProcessWatch()
        watch.watch(p.pid, psutil.Process(p.pid).create_time())
        for _ in range(4):
            info = watch.refresh(p.pid, time.monotonic())
            time.sleep(0.5)
        assert info is not None and info.cpu_busy < 0.2  # the process itself does next to nothing
        assert (info.idle_since is not None) == idle, info
    finally:
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        p.kill()
        p.wait(timeout=10)


def test_a_rank_with_more_children_than_the_agent_reads_is_active(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diag.agent.observe import idleness

    monkeypatch.setattr(idleness, "MAX_CHILDREN", 0)  # its one sleeping child is one too many
    p = subprocess.Popen([sys.executable, "-c", CHILD_SLEEPS], start_new_session=True)
    try:
        time.sleep(1.0)
        watch = ProcessWatch()
        watch.watch(p.pid, psutil.Process(p.pid).create_time())
        for _ in range(3):
            info = watch.refresh(p.pid, time.monotonic())
            time.sleep(0.5)
        assert info is not None and info.cpu_busy < 0.2 and info.idle_since is None, info
    finally:
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        p.kill()
        p.wait(timeout=10)
