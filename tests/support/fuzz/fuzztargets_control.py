"""Fuzz targets for what a rank takes from the agent on its control channel: the protobuf bytes
of an AgentMessage (a command or a persist acknowledgement) and of a RegisterReply, decoded and
checked the way the rank's client does before acting (a DUMP's directory confined as well)."""

from __future__ import annotations

from pathlib import Path

from fuzzkit import FuzzTarget
from google.protobuf.message import DecodeError

from diag.formats.untrusted import UntrustedInput
from diag.proto import control_pb2 as pb
from diag.trainer.control.dumpbase import DumpBases
from diag.trainer.control.message import AgentCommand, CommandKind, decode, hello_of

REFUSALS = (DecodeError, UntrustedInput)


def _message_seeds(scratch: Path) -> list[bytes]:
    def cmd(**kw) -> bytes:
        return pb.AgentMessage(command=pb.Command(**kw)).SerializeToString()

    ack = pb.PersistAck(step=12, ok=True, seconds=0.25, bytes=1 << 20, committed=True)
    return [
        cmd(id="c1-r0", kind=pb.COMMAND_KIND_FLUSH, reason="incident"),
        cmd(id="c2-r0", kind=pb.COMMAND_KIND_EXIT, exit_code=143, reason="drain"),
        cmd(id="c3-r1", kind=pb.COMMAND_KIND_DUMP, dump_dir=str(scratch / "incident" / "n1")),
        pb.AgentMessage(persist_ack=ack).SerializeToString(),
        pb.AgentMessage(persist_ack=pb.PersistAck(step=3, error="disk full")).SerializeToString(),
    ]


def parse_agent_message(path: Path) -> object:
    item = decode(path.read_bytes(), str(path))
    if isinstance(item, AgentCommand) and item.kind is CommandKind.DUMP:
        return DumpBases((path.parent,)).confine(item.dump_dir)
    return item


def parse_register_reply(path: Path) -> object:
    return hello_of(pb.RegisterReply.FromString(path.read_bytes()), str(path))


TARGETS = [
    FuzzTarget("control-agent-message", _message_seeds, parse_agent_message, refusals=REFUSALS),
    FuzzTarget(
        "control-register-reply",
        lambda _: [pb.RegisterReply(agent_pid=4242, agent_version="0.1.0").SerializeToString()],
        parse_register_reply,
        refusals=REFUSALS,
    ),
]
