"""The committed gRPC stubs match the .proto files, and import under the diag namespace."""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.proto import generate


def test_stubs_are_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    written = generate.generate(tmp_path)
    assert written, "no .proto files found"
    stale = [p.name for p in written if p.read_bytes() != (generate.HERE / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run scripts/gen_proto.sh and commit the result"


def test_stubs_import_under_diag() -> None:
    from diag.proto import control_pb2, control_pb2_grpc

    assert control_pb2.DESCRIPTOR.name == "diag/proto/control.proto"
    assert hasattr(control_pb2_grpc, "ControlStub")
    msg = control_pb2.AgentMessage(command=control_pb2.Command(id="x", kind=2))
    again = control_pb2.AgentMessage.FromString(msg.SerializeToString())
    assert again.WhichOneof("body") == "command" and again.command.kind == 2
