"""py-spy as a subprocess: Python and native stacks of a running rank, parsed into our types.

All ranks are dumped at once (one py-spy process each, started together) so the total time is
that of the slowest dump, not the sum. A rank in uninterruptible sleep (D state) would block a
ptrace-based dump, so it gets a non-blocking, Python-only read instead, and its state is recorded.
Who starts each py-spy is a `Launcher`: the agent itself, or the root helper of an agent that
gave up root (agent.privilege).
"""

from __future__ import annotations

import datetime as dt
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from diag.agent.observe.procs import proc_state, proc_state_word
from diag.agent.observe.rankproof import RankClaim
from diag.formats.stackdump import RankDump, parse_pyspy_json


@dataclass(frozen=True)
class DumpTarget:
    rank: int
    world_size: int
    pid: int
    local_rank: int = -1
    node: str = ""
    # What showed the PID to be the rank (its meta's claim): a dump helper proves it again.
    claim: RankClaim | None = None


def pyspy_binary() -> str:
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    raise FileNotFoundError(
        "py-spy not found on PATH or next to the Python interpreter; install it (pip install "
        "py-spy) in the agent's image"
    )


@dataclass(frozen=True)
class SpyExit:
    """How one py-spy run ended, as its launcher saw it."""

    returncode: int | None  # None: still running at the deadline (it was killed)
    peak_rss: int  # bytes, 0 when unknown
    stdout: bytes
    stderr: bytes


class Spy(Protocol):
    """One py-spy run under way."""

    def finish(self, deadline: float) -> SpyExit:
        """How it ended (killed at `deadline` if still running); SpyRefused when it never ran
        on the target after all."""
        ...


class SpyRefused(Exception):
    """py-spy could not be started on a target: the message says why."""


class Launcher(Protocol):
    """Starts py-spy on a target: itself (`LocalLauncher`), or through the root dump helper of
    an agent that dropped its privileges (agent.privilege.helperspy). The command line is the
    launcher's own (`pyspy_command`), never taken from the caller."""

    def start(self, target: DumpTarget, native: bool, nonblocking: bool, timeout: float) -> Spy:
        """Raises SpyRefused."""
        ...


def pyspy_command(binary: str, pid: int, native: bool, nonblocking: bool) -> list[str]:
    cmd = [binary, "dump", "--json", "--pid", str(pid)]
    if native and not nonblocking:
        cmd.append("--native")
    if nonblocking:
        cmd.append("--nonblocking")
    return cmd


class LocalLauncher:
    """py-spy as this process's child."""

    def __init__(self) -> None:
        self.binary = pyspy_binary()  # FileNotFoundError when missing

    def start(self, target: DumpTarget, native: bool, nonblocking: bool, timeout: float) -> Spy:
        cmd = pyspy_command(self.binary, target.pid, native, nonblocking)
        # Output to unlinked files, not pipes: py-spy can write any amount without us reading
        # it meanwhile, and the agent reaps it itself with wait4 (for its peak memory).
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 (finish closes)
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        except OSError as e:
            out.close()
            err.close()
            # The kernel refuses to run a binary whose file capability (cap_sys_ptrace, in the
            # non-root image) is outside the container's bounding set: EPERM at exec.
            raise SpyRefused(_start_error(self.binary, e)) from e
        return _LocalSpy(proc, out, err)


@dataclass
class _LocalSpy:
    proc: subprocess.Popen
    out: IO[bytes]
    err: IO[bytes]

    def finish(self, deadline: float) -> SpyExit:
        with self.out, self.err:
            peak = reap(self.proc, deadline)
            if peak is None:
                self.proc.kill()
                self.proc.wait()
                return SpyExit(None, 0, b"", b"")
            self.out.seek(0)
            self.err.seek(0)
            return SpyExit(self.proc.returncode, peak, self.out.read(), self.err.read())


@dataclass
class _Running:
    target: DumpTarget
    spy: Spy | None
    started: float
    state: str
    native: bool
    deadline: float  # its own: `timeout` from when it started, not from when the pass began
    error: str = ""


def dump_all(
    targets: list[DumpTarget],
    native: bool = True,
    timeout: float = 10.0,
    parallel: int | None = None,
    on_done: Callable[[RankDump], None] | None = None,
    widen: Callable[[int], int] | None = None,
    launcher: Launcher | None = None,
) -> list[RankDump]:
    """Dumps every target, `parallel` at a time (default: one per usable CPU; the incident path
    decides it from the container's limits, see agent.parallelism: a native dump of a rank
    blocked in a collective costs ~0.7 s of CPU and ~300 MB while py-spy loads libtorch's
    symbols). Never raises for one rank's failure: it is recorded in that rank's dump.
    `on_done` sees each dump as soon as it is taken, in the order of `targets`; `widen`, given
    the largest peak resident size (bytes) a py-spy of this pass reached so far, returns how
    many may run at once from then on. `launcher` starts each py-spy (default: this process)."""
    if launcher is None:
        try:
            launcher = LocalLauncher()
        except FileNotFoundError as e:
            return [_failed(t, proc_state_word(t.pid), native, str(e), 0.0) for t in targets]
    width = max(1, parallel or len(os.sched_getaffinity(0)))
    queue = list(targets)
    running: list[_Running] = []
    done: dict[int, RankDump] = {}
    peak = 0
    while queue or running:
        while queue and len(running) < width:
            running.append(_start(launcher, queue.pop(0), native, timeout))
        r = running.pop(0)
        dump, rss = _finish(r, timeout)
        done[r.target.rank] = dump
        if widen is not None and rss > peak:
            peak = rss
            width = max(1, widen(peak))
        if on_done is not None:
            on_done(dump)
    return [done[t.rank] for t in targets]


def _start(launcher: Launcher, t: DumpTarget, native: bool, timeout: float) -> _Running:
    # Each dump has `timeout` of its own: with one deadline for the pass, the ranks queued behind
    # a busy node's first native dumps were given up as "did not finish" before they started.
    deadline = time.monotonic() + timeout
    state = proc_state(t.pid)
    word = proc_state_word(t.pid)
    if state in ("", "Z", "X"):
        return _Running(
            t,
            None,
            time.monotonic(),
            word or "gone",
            native,
            deadline,
            "process exited before its stack could be taken",
        )
    # A rank in uninterruptible sleep would block a ptrace-based dump.
    nonblocking = state == "D"
    try:
        spy = launcher.start(t, native, nonblocking, timeout)
    except SpyRefused as e:
        return _Running(t, None, time.monotonic(), word, native, deadline, str(e))
    return _Running(t, spy, time.monotonic(), word, native and not nonblocking, deadline)


def _start_error(binary: str, e: OSError) -> str:
    msg = f"py-spy could not be started: {e}"
    if file_has_capability(binary, CAP_SYS_PTRACE):
        msg += (
            "; it carries cap_sys_ptrace as a file capability, so its container needs SYS_PTRACE "
            "in capabilities.add and allowPrivilegeEscalation: true"
        )
    return msg


def reap(proc: subprocess.Popen, deadline: float) -> int | None:
    """Waits for `proc` until `deadline`; its peak resident size in bytes once it exited, None
    if it is still running."""
    fd = os.pidfd_open(proc.pid)
    try:
        ready, _, _ = select.select([fd], [], [], max(0.1, deadline - time.monotonic()))
    finally:
        os.close(fd)
    if not ready:
        return None
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024  # KiB on Linux


def _finish(r: _Running, timeout: float) -> tuple[RankDump, int]:
    """The rank's dump, and the peak resident size of its py-spy (0 when unknown)."""
    if r.spy is None:
        return _failed(r.target, r.state, r.native, r.error, 0.0), 0
    try:
        ended = r.spy.finish(r.deadline)
    except SpyRefused as e:
        return _failed(r.target, r.state, r.native, str(e), time.monotonic() - r.started), 0
    if ended.returncode is None:
        failed = _failed(
            r.target,
            r.state,
            r.native,
            f"py-spy did not finish within {timeout:g} s",
            time.monotonic() - r.started,
        )
        return failed, 0
    return _parse(r, ended), ended.peak_rss


def _parse(r: _Running, ended: SpyExit) -> RankDump:
    took = time.monotonic() - r.started
    if ended.returncode != 0:
        msg = ended.stderr.decode(errors="replace").strip().splitlines()
        return _failed(
            r.target,
            r.state,
            r.native,
            f"py-spy exited {ended.returncode}: {msg[0] if msg else ''}",
            took,
        )
    try:
        threads = parse_pyspy_json(ended.stdout.decode(errors="replace"))
    except ValueError as e:
        return _failed(r.target, r.state, r.native, f"unreadable py-spy output: {e}", took)
    return RankDump(
        rank=r.target.rank,
        world_size=r.target.world_size,
        pid=r.target.pid,
        node=r.target.node,
        local_rank=r.target.local_rank,
        process_state=r.state,
        native=r.native,
        captured_at=_utc_now(),
        capture_seconds=round(took, 4),
        threads=threads,
    )


def _failed(t: DumpTarget, state: str, native: bool, error: str, took: float) -> RankDump:
    return RankDump(
        rank=t.rank,
        world_size=t.world_size,
        pid=t.pid,
        node=t.node,
        local_rank=t.local_rank,
        process_state=state,
        native=native,
        captured_at=_utc_now(),
        capture_seconds=round(took, 4),
        error=error,
    )


def _utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


CAP_SYS_PTRACE = 19


def can_trace() -> bool:
    """Whether stack dumps can work: this process may ptrace others (root or CAP_SYS_PTRACE), or
    the py-spy binary carries CAP_SYS_PTRACE as a file capability (the non-root image) and the
    container grants it (the capability is in the bounding set, privilege escalation allowed)."""
    if os.geteuid() == 0:
        return True
    status = _proc_status()
    if int(status.get("CapEff", "0"), 16) & (1 << CAP_SYS_PTRACE):
        return True
    if not int(status.get("CapBnd", "0"), 16) & (1 << CAP_SYS_PTRACE):
        return False
    if status.get("NoNewPrivs", "0") != "0":
        return False  # file capabilities are ignored under no_new_privs
    try:
        return file_has_capability(pyspy_binary(), CAP_SYS_PTRACE)
    except FileNotFoundError:
        return False


def _proc_status() -> dict[str, str]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key] = value.strip()
    except OSError:
        pass
    return out


def file_has_capability(path: str, cap: int) -> bool:
    """Whether `path` has `cap` in its permitted file capabilities (security.capability)."""
    try:
        raw = os.getxattr(os.path.realpath(path), "security.capability")
    except OSError:
        return False
    if len(raw) < 12:
        return False
    # struct vfs_cap_data: magic_etc, then {permitted, inheritable} for caps 0-31, 32-63.
    word, bit = divmod(cap, 32)
    offset = 4 + 8 * word
    if len(raw) < offset + 4:
        return False
    return bool(int.from_bytes(raw[offset : offset + 4], "little") & (1 << bit))
