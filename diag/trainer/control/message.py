"""What the agent sends a rank, turned into our types and checked before the rank acts on it.

The agent at the other end was checked (diag.trainer.control.peer), but a rank still takes nothing
it acts on unchecked: a command kind it does not know, an exit code no process can have, a step
below -1, a count below 0, a text with control characters or of any length is refused here, and
the rank says so instead of acting on it. Protobuf stays at this edge.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from diag.formats.untrusted import UntrustedInput, bounded_int, printable

MAX_ID = 128
MAX_TEXT = 4096
MAX_PATH = 4096
INT64_MAX = 2**63 - 1
MAX_SECONDS = 1e9
MAX_PID = 2**31 - 1
MAX_WALL = 1e11  # Unix seconds: past year 5000


class CommandKind(enum.IntEnum):
    """The numbers are control.proto's CommandKind."""

    FLUSH = 1
    EXIT = 2
    DUMP = 3
    RECOVER = 4


@dataclass(frozen=True)
class AgentCommand:
    id: str
    kind: CommandKind
    reason: str = ""
    dump_dir: str = ""  # DUMP: where the agent wants the stack file (checked again on writing)
    exit_code: int = 0  # EXIT
    verdict_time: float = 0.0  # RECOVER: when the agent reached its verdict (Unix seconds)


@dataclass(frozen=True)
class PersistAck:
    step: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    bytes: int = 0
    committed: bool = False


@dataclass(frozen=True)
class ReplicaAck:
    """The agent replicates this node's snapshots (`on`); every holder holds the replication
    round's step `step` (-1: none yet) of launch `run`."""

    on: bool
    step: int = -1
    run: str = ""


@dataclass(frozen=True)
class AgentHello:
    agent_pid: int
    agent_version: str
    node: str = ""  # the agent's --node ("": an agent that does not say)


class RefusedCommand(UntrustedInput):
    """A command refused with a usable id: the rank reports the refusal under it."""

    def __init__(self, source: str, problem: str, command_id: str) -> None:
        super().__init__(source, problem)
        self.command_id = command_id


def _text(value: str, limit: int, what: str, source: str) -> str:
    if len(value) > limit:
        raise UntrustedInput(source, f"{what} is {len(value)} characters, over {limit}")
    return printable(value, keep_newlines=False)


def command_of(cmd: Any, source: str) -> AgentCommand:
    """A `control_pb2.Command`, checked."""
    cid = cmd.id
    if not cid or len(cid) > MAX_ID or printable(cid, keep_newlines=False) != cid:
        raise UntrustedInput(source, f"command id {cid[:MAX_ID]!r} is empty, long or unprintable")
    try:
        kind = CommandKind(cmd.kind)
    except ValueError:
        raise RefusedCommand(source, f"unknown command kind {cmd.kind}", cid) from None
    try:
        reason = _text(cmd.reason, MAX_TEXT, "the reason", source)
        exit_code = bounded_int(cmd.exit_code, lo=0, hi=255, what="exit code", source=source)
        dump_dir = cmd.dump_dir
        if len(dump_dir) > MAX_PATH or "\x00" in dump_dir:
            raise UntrustedInput(source, "the dump directory is too long or has a NUL byte")
        if kind is CommandKind.DUMP and not dump_dir:
            raise UntrustedInput(source, "DUMP names no directory")
        at = float(cmd.verdict_time)
        if not math.isfinite(at) or not 0.0 <= at <= MAX_WALL:
            raise UntrustedInput(source, f"verdict time {at!r} is not a time")
    except UntrustedInput as e:
        raise RefusedCommand(source, e.problem, cid) from None
    return AgentCommand(cid, kind, reason, dump_dir, exit_code, at)


def ack_of(ack: Any, source: str) -> PersistAck:
    """A `control_pb2.PersistAck`, checked."""
    step = bounded_int(ack.step, lo=-1, hi=INT64_MAX, what="step", source=source)
    size = bounded_int(ack.bytes, lo=0, hi=INT64_MAX, what="byte count", source=source)
    seconds = float(ack.seconds)
    if not (math.isfinite(seconds) and 0.0 <= seconds <= MAX_SECONDS):
        raise UntrustedInput(source, f"persist time {seconds!r} is not a duration")
    error = _text(ack.error, MAX_TEXT, "the error", source)
    return PersistAck(step, bool(ack.ok), error, seconds, size, bool(ack.committed))


def replica_ack_of(ack: Any, source: str) -> ReplicaAck:
    """A `control_pb2.ReplicaAck`, checked."""
    step = bounded_int(ack.step, lo=-1, hi=INT64_MAX, what="step", source=source)
    run = ack.run
    if len(run) > MAX_TEXT or printable(run, keep_newlines=False) != run:
        raise UntrustedInput(source, "the replica's launch is long or unprintable")
    return ReplicaAck(bool(ack.on), step, run)


def message_of(msg: Any, source: str) -> AgentCommand | PersistAck | ReplicaAck:
    """A `control_pb2.AgentMessage`, checked."""
    which = msg.WhichOneof("body")
    if which == "command":
        return command_of(msg.command, source)
    if which == "persist_ack":
        return ack_of(msg.persist_ack, source)
    if which == "replica_ack":
        return replica_ack_of(msg.replica_ack, source)
    raise UntrustedInput(source, "the agent sent a message with no body")


def hello_of(reply: Any, source: str) -> AgentHello:
    """A `control_pb2.RegisterReply`, checked."""
    pid = bounded_int(reply.agent_pid, lo=0, hi=MAX_PID, what="agent pid", source=source)
    return AgentHello(
        pid,
        _text(reply.agent_version, MAX_ID, "the agent version", source),
        _text(reply.node, MAX_ID * 2, "the agent's node", source),
    )


def decode(data: bytes, source: str) -> AgentCommand | PersistAck | ReplicaAck:
    """An AgentMessage from its wire bytes (what the stream hands the rank), checked; refuses
    with protobuf's DecodeError or UntrustedInput."""
    from diag.proto import control_pb2 as pb

    return message_of(pb.AgentMessage.FromString(data), source)
