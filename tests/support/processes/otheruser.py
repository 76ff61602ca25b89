"""Processes and directories of another user, for the tests of what a root agent does next to a
trainer that is not root: a directory tree that user can reach, and a "rank" forked from the
test process (whose imports it inherits: the interpreter itself may lie where that user cannot
read, as under /root) that writes a journal and waits in a named function."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

from diag.formats.journalmeta import GroupInfo, JournalMeta, journal_path, write_meta
from diag.formats.journalwriter import JournalWriter
from diag.formats.records import DType, OpCode, OpFlag

NOBODY = 65534
_PR_SET_DUMPABLE = 4


@contextmanager
def shared_base(prefix: str) -> Iterator[Path]:
    """A directory in /dev/shm that every user may traverse (0711), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    os.chmod(base, 0o711)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def private_dir(path: Path, uid: int = NOBODY) -> Path:
    path.mkdir(mode=0o700)
    os.chown(path, uid, uid)
    return path


@dataclass
class Child:
    pid: int

    def wait(self, timeout: float = 30.0) -> int:
        """Its exit code, once it exited by itself."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"process {self.pid} did not exit within {timeout} s")

    def stop(self) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def fork_as(uid: int, body: Callable[[], None], *, orphan: bool = False) -> Child:
    """`body` in a child process running as `uid` (and its gid); the child never returns.
    `orphan`: a grandchild instead, left to init, so it is no descendant of this process (a
    test in which this process plays the agent)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(r)
            if orphan and os.fork() != 0:
                os._exit(0)
            os.setgroups([uid])
            os.setgid(uid)
            os.setuid(uid)
            # A changed uid makes a process undumpable until it execs; a trainer started as its
            # user is dumpable (its /proc files are its user's), so this one is made so.
            ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
            os.write(w, os.getpid().to_bytes(4, "little"))
            os.close(w)
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    child = int.from_bytes(os.read(r, 4), "little")  # it runs as `uid` now
    os.close(r)
    if orphan:
        os.waitpid(pid, 0)
    return Child(child)


def meta_of(pid: int, job: str = "job", rank: int = 0, world: int = 1) -> JournalMeta:
    return JournalMeta(
        job=job, rank=rank, world_size=world, local_rank=rank, local_world_size=world, pid=pid,
        pid_start_time=psutil.Process(pid).create_time(), node="n",
        groups=(GroupInfo(0, "default_pg", tuple(range(world))),),
    )  # fmt: skip


def hung_rank(run_dir: Path, ready: Path, job: str = "job") -> Callable[[], None]:
    """A rank body: one collective left pending in its journal, then a wait in a function whose
    name a stack dump shows."""

    def body() -> None:
        w = JournalWriter(journal_path(run_dir, job, 0), rank=0, world_size=1, local_rank=0)
        w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 0, -1, 1, 4096, 1)
        write_meta(w.path, meta_of(os.getpid(), job))
        ready.touch()
        rank_waits_in_a_collective_for_ever()

    return body


def maps_file(path: Path, ready: Path, writable: bool) -> Callable[[], None]:
    """A body that maps `path` (shared; writable or read-only), then waits."""

    def body() -> None:
        import mmap

        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, prot)
        ready.touch()
        while m:
            time.sleep(1)

    return body


def rank_waits_in_a_collective_for_ever() -> None:
    while True:
        time.sleep(1)
