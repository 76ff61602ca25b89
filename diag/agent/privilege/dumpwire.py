"""The messages between an agent and its root dump helper, over a SOCK_SEQPACKET socket pair.

A request is one fixed-size record (the claim to prove, what to dump, the time allowed) sent with
three descriptors: the socket to answer on, and the files py-spy's output and errors go to (the
agent's own, unlinked). The answer is one record on that socket. The helper takes nothing else
from the agent: no command line, no path, no user. A request out of shape is refused whole.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import Enum

from diag.agent.observe.rankproof import RankClaim

MAX_TIMEOUT = 600.0  # seconds a dump may take (the agent's --pyspy-timeout is bounded below it)
MAX_REASON = 1024  # bytes of an answer's reason
FDS = 3  # answer socket, stdout file, stderr file

_REQUEST = struct.Struct("<idQQQBd")  # pid, start time, journal dev, inode, pid ns, flags, timeout
_REPLY = struct.Struct("<BiQ")  # outcome, py-spy's exit code, its peak resident size
_NATIVE, _NONBLOCKING = 1, 2


class Outcome(Enum):
    RAN = 0  # py-spy ran to its end: its exit code says how it went
    REFUSED = 1  # not a proven rank of the ranks' user: nothing ran
    NOT_STARTED = 2  # py-spy could not be started
    TIMED_OUT = 3  # py-spy was killed at the deadline
    GONE = 4  # the rank exited (or its PID changed hands) during the dump: output discarded


@dataclass(frozen=True)
class DumpRequest:
    claim: RankClaim  # one file: the journal
    native: bool
    nonblocking: bool
    timeout: float


@dataclass(frozen=True)
class DumpReply:
    outcome: Outcome
    returncode: int = 0
    peak_rss: int = 0
    reason: str = ""


class BadMessage(ValueError):
    pass


def encode_request(r: DumpRequest) -> bytes:
    ((dev, ino),) = r.claim.files
    flags = (_NATIVE if r.native else 0) | (_NONBLOCKING if r.nonblocking else 0)
    return _REQUEST.pack(
        r.claim.pid, r.claim.start_time, dev, ino, r.claim.pid_ns, flags, r.timeout
    )


def decode_request(data: bytes) -> DumpRequest:
    if len(data) != _REQUEST.size:
        raise BadMessage(f"a request of {len(data)} bytes, not {_REQUEST.size}")
    pid, start, dev, ino, pid_ns, flags, timeout = _REQUEST.unpack(data)
    if pid <= 0:
        raise BadMessage(f"pid {pid}")
    if not math.isfinite(start) or start <= 0:
        raise BadMessage(f"start time {start}")
    if flags & ~(_NATIVE | _NONBLOCKING):
        raise BadMessage(f"flags {flags:#x}")
    if not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT:
        raise BadMessage(f"timeout {timeout}")
    claim = RankClaim(pid, start, frozenset({(dev, ino)}), pid_ns)
    return DumpRequest(claim, bool(flags & _NATIVE), bool(flags & _NONBLOCKING), timeout)


def encode_reply(r: DumpReply) -> bytes:
    reason = r.reason.encode(errors="replace")[:MAX_REASON]
    return _REPLY.pack(r.outcome.value, r.returncode, max(0, r.peak_rss)) + reason


def decode_reply(data: bytes) -> DumpReply:
    if not _REPLY.size <= len(data) <= _REPLY.size + MAX_REASON:
        raise BadMessage(f"an answer of {len(data)} bytes")
    outcome, code, rss = _REPLY.unpack_from(data)
    try:
        kind = Outcome(outcome)
    except ValueError as e:
        raise BadMessage(f"outcome {outcome}") from e
    reason = data[_REPLY.size :].decode(errors="replace")
    return DumpReply(kind, code, rss, "".join(c for c in reason if c.isprintable()))
