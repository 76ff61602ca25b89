"""The agent's end of its root dump helper: starts the helper (before the agent gives up root)
and launches py-spy through it, one request per dump (evidence.pyspy's `Launcher`).

py-spy's output goes to the agent's own unlinked files, handed over with the request; the
helper answers on a socket of that request alone, so dumps run in parallel as they do when the
agent runs py-spy itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

from diag.agent.evidence.pyspy import DumpTarget, SpyExit, SpyRefused
from diag.agent.privilege.dumpwire import (
    MAX_REASON,
    BadMessage,
    DumpRequest,
    Outcome,
    decode_reply,
    encode_request,
)

log = logging.getLogger(__name__)

ANSWER_SLACK = 5.0  # seconds past its deadline the helper has to kill, reap and answer
_START_TIMEOUT = 10.0


class DumpHelper:
    """The helper process and the channel to it."""

    def __init__(self, proc: subprocess.Popen, channel: socket.socket) -> None:
        self.proc = proc
        self.channel = channel
        self._gone_said = False

    @classmethod
    def start(cls, ranks_uid: int) -> DumpHelper:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [
            sys.executable, "-m", "diag.agent.privilege.dumper", "--channel",
            str(theirs.fileno()), "--ranks-uid", str(ranks_uid), "--agent-pid", str(os.getpid()),
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        return cls(proc, mine)

    def start_spy(
        self, target: DumpTarget, native: bool, nonblocking: bool, timeout: float
    ) -> _HelperSpy:
        claim = target.claim
        if claim is None or len(claim.files) != 1:
            raise SpyRefused("no claim of the rank's to prove to the dump helper")
        request = DumpRequest(claim, native, nonblocking, min(timeout, 600.0))
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 (finish closes)
        try:
            socket.send_fds(
                self.channel,
                [encode_request(request)],
                [theirs.fileno(), out.fileno(), err.fileno()],
            )
        except OSError as e:
            for f in (mine, out, err):
                f.close()
            raise SpyRefused(self._gone(e)) from e
        finally:
            theirs.close()
        return _HelperSpy(mine, out, err, request.timeout)

    def _gone(self, e: OSError) -> str:
        code = self.proc.poll()
        why = f"the dump helper is gone ({'exit ' + str(code) if code is not None else e})"
        if not self._gone_said:
            self._gone_said = True
            log.error("%s: no stacks can be taken until the agent restarts", why)
        return why

    def close(self, timeout: float = _START_TIMEOUT) -> None:
        self.channel.close()  # the helper ends at the end of its channel
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class HelperLauncher:
    """evidence.pyspy's Launcher over a DumpHelper."""

    def __init__(self, helper: DumpHelper) -> None:
        self.helper = helper

    def start(
        self, target: DumpTarget, native: bool, nonblocking: bool, timeout: float
    ) -> _HelperSpy:
        return self.helper.start_spy(target, native, nonblocking, timeout)


@dataclass
class _HelperSpy:
    answer: socket.socket
    out: IO[bytes]
    err: IO[bytes]
    timeout: float
    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = time.monotonic()

    def finish(self, deadline: float) -> SpyExit:
        with contextlib.closing(self.answer), self.out, self.err:
            # The helper kills py-spy at its own deadline; it answers shortly after.
            until = max(deadline, self.started + self.timeout) + ANSWER_SLACK
            ready, _, _ = select.select([self.answer], [], [], max(0.0, until - time.monotonic()))
            if not ready:
                raise SpyRefused("the dump helper did not answer in time")
            try:
                reply = decode_reply(self.answer.recv(64 + MAX_REASON))
            except (OSError, BadMessage) as e:
                raise SpyRefused(f"no answer from the dump helper: {e}") from e
            if reply.outcome is Outcome.TIMED_OUT:
                return SpyExit(None, 0, b"", b"")
            if reply.outcome is not Outcome.RAN:
                raise SpyRefused(f"the dump helper refused: {reply.reason or reply.outcome.name}")
            self.out.seek(0)
            self.err.seek(0)
            return SpyExit(reply.returncode, reply.peak_rss, self.out.read(), self.err.read())
