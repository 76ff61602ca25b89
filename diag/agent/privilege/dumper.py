"""The root dump helper: the only part of a privilege-dropped agent that keeps root, and it uses
it for one thing: py-spy on a process it has itself proven to be a rank of the ranks' user.

It is started by the agent before the agent gives up root (`python -m
diag.agent.privilege.dumper`), inherits one end of a socket pair and serves requests on it
(dumpwire.py) until the agent closes it or dies. The agent is not believed: every request is
proven again here (rankproof.py, with the ranks' uid as the only trusted user, never root, and
neither the agent nor this helper nor a child of theirs), the command line is built here, and
the time allowed is bounded. A rank that exits during its dump has its output discarded: its PID
may name another process by then.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

from diag.agent.evidence.pyspy import pyspy_binary, pyspy_command, reap
from diag.agent.observe.rankproof import RankProver
from diag.agent.privilege.dumpwire import (
    FDS,
    BadMessage,
    DumpReply,
    Outcome,
    decode_request,
    encode_reply,
)
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

MAX_RUNNING = 64  # dumps at once; more are refused (an agent dumps one per local rank)
_PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 256


class Helper:
    def __init__(self, channel: socket.socket, ranks_uid: int, agent_pid: int) -> None:
        self.channel = channel
        self.binary = pyspy_binary()
        self.prover = RankProver(
            Owners(frozenset({ranks_uid})), agent_pids=frozenset({agent_pid, os.getpid()})
        )
        self._proving = threading.Lock()  # the prover's cache is not for threads at once
        self._slots = threading.BoundedSemaphore(MAX_RUNNING)
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def serve(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.channel, _MAX_REQUEST, FDS)
            except OSError:
                return
            if not data and not fds:
                return  # the agent closed its end or died
            if not self._slots.acquire(blocking=False):
                _answer_and_close(fds, DumpReply(Outcome.REFUSED, reason="too many dumps at once"))
                continue
            threading.Thread(target=self._handle, args=(data, fds), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            for proc in self._running:
                with contextlib.suppress(OSError):
                    proc.kill()

    def _handle(self, data: bytes, fds: list[int]) -> None:
        try:
            reply = self._dump(data, fds)
            _answer_and_close(fds, reply)
        finally:
            self._slots.release()

    def _dump(self, data: bytes, fds: list[int]) -> DumpReply:
        if len(fds) != FDS or not _kinds_fit(fds):
            return DumpReply(
                Outcome.REFUSED, reason="a request needs an answer socket and two files"
            )
        try:
            request = decode_request(data)
        except BadMessage as e:
            return DumpReply(Outcome.REFUSED, reason=f"bad request: {e}")
        pid = request.claim.pid
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return DumpReply(Outcome.REFUSED, reason=f"no process {pid} is running")
        try:
            with self._proving:
                proof = self.prover.check(request.claim)
            if not proof:
                return DumpReply(Outcome.REFUSED, reason=proof.reason)
            cmd = pyspy_command(self.binary, pid, request.native, request.nonblocking)
            deadline = time.monotonic() + request.timeout
            try:
                proc = subprocess.Popen(
                    cmd, stdout=fds[1], stderr=fds[2], stdin=subprocess.DEVNULL, close_fds=True
                )
            except OSError as e:
                return DumpReply(Outcome.NOT_STARTED, reason=f"py-spy could not be started: {e}")
            with self._lock:
                self._running.add(proc)
            try:
                peak = reap(proc, deadline)
                if peak is None:
                    proc.kill()
                    proc.wait()
                    return DumpReply(Outcome.TIMED_OUT)
            finally:
                with self._lock:
                    self._running.discard(proc)
            if _exited(pidfd):
                os.ftruncate(fds[1], 0)
                return DumpReply(Outcome.GONE, reason=f"process {pid} exited during its dump")
            return DumpReply(Outcome.RAN, proc.returncode or 0, peak)
        finally:
            os.close(pidfd)


def _kinds_fit(fds: list[int]) -> bool:
    """An answer socket, then two regular files (the agent's unlinked temp files)."""
    try:
        modes = [os.fstat(fd).st_mode for fd in fds]
    except OSError:
        return False
    return stat.S_ISSOCK(modes[0]) and all(stat.S_ISREG(m) for m in modes[1:])


def _exited(pidfd: int) -> bool:
    ready, _, _ = select.select([pidfd], [], [], 0)
    return bool(ready)


def _answer_and_close(fds: list[int], reply: DumpReply) -> None:
    try:
        if fds:
            with contextlib.suppress(OSError):
                os.write(fds[0], encode_reply(reply))
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="diag's root dump helper (started by the agent)")
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--ranks-uid", type=int, required=True)
    parser.add_argument("--agent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.agent_pid or args.ranks_uid <= 0:
        return 2  # the agent is already gone, or this was not started by one
    logging.basicConfig(level=logging.WARNING, format="diag dump helper: %(message)s")
    channel = socket.socket(fileno=args.channel)
    helper = Helper(channel, args.ranks_uid, args.agent_pid)
    try:
        helper.serve()
    finally:
        helper.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
