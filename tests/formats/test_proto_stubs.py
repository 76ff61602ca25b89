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


def test_xpu_timer_stacktrace_module_reads_xpu_timer_bytes() -> None:
    """The messages-only module of xpu_timer's stack traces has no gRPC stub, and reads bytes
    written under xpu_timer's own package name (the wire format does not carry it)."""
    from mergekit import Stacktrace as XpuTimerStacktrace

    from diag.proto import hosting_service_pb2

    assert not (generate.HERE / "hosting_service_pb2_grpc.py").exists()
    src = XpuTimerStacktrace(pid=7, rank=3, process_state="S (sleeping)")
    t = src.py_stacktrace.add(thread_name="MainThread", os_thread_id=7, thread_id=2**40)
    t.frames.add(func_name="main", file_name="/srv/train.py:12", module="unknown")
    g = src.stacktrace.add(pid=7, thread_name="python")
    g.frames.add(func_name="??", file_name="??", origin="#0  0x0 in ?? ()")
    st = hosting_service_pb2.Stacktrace.FromString(src.SerializeToString())
    assert (st.pid, st.rank, st.process_state) == (7, 3, "S (sleeping)")
    assert st.py_stacktrace[0].frames[0].file_name == "/srv/train.py:12"
    assert st.stacktrace[0].frames[0].origin == "#0  0x0 in ?? ()"


def test_the_stacktrace_reading_view_is_a_subset_of_xpu_timers_messages() -> None:
    """Every field the reading view declares is its namesake's in hosting_service.proto: same
    number, type, label and message type; what it leaves out is only what the merge never
    reads."""
    from diag.proto import hosting_service_pb2, stacktrace_view_pb2

    full, view = hosting_service_pb2.DESCRIPTOR, stacktrace_view_pb2.DESCRIPTOR
    assert set(view.message_types_by_name) <= set(full.message_types_by_name)
    left_out = set()
    for name, m in view.message_types_by_name.items():
        whole = full.message_types_by_name[name]
        for f in m.fields:
            g = whole.fields_by_name[f.name]
            assert (f.number, f.type, f.is_repeated) == (g.number, g.type, g.is_repeated), f.name
            if f.message_type is not None:
                assert f.message_type.name == g.message_type.name
        left_out |= {f"{name}.{f.name}" for f in whole.fields if f.name not in m.fields_by_name}
    assert left_out == {
        "PstackFrame.origin",
        "Stacktrace.device_stacktrace",
        "Stacktrace.device_status",
    }
