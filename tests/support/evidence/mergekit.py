"""Builders shared by the `diag merge` tests: rank dumps, incident directories, verdicts."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from diag.formats.stackdump import Frame, RankDump, ThreadStack

APP = "/srv/app/train.py"
C10D = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"


def py(func: str, line: int = 1, file: str = APP) -> Frame:
    return Frame(func=func, file=file, line=line)


def native(func: str, lib: str = "/usr/lib/x86_64-linux-gnu/libc.so.6") -> Frame:
    return Frame(func=func, file=lib, line=0, native=True, module=lib)


def thread(frames: Sequence[Frame], name: str = "MainThread", tid: int = 1) -> ThreadStack:
    return ThreadStack(tid=tid, os_tid=tid, name=name, frames=tuple(frames))


def rank_dump(
    rank: int,
    world: int,
    *threads: ThreadStack,
    state: str = "S (sleeping)",
    error: str = "",
    native_threads: Iterable[ThreadStack] = (),
) -> RankDump:
    return RankDump(
        rank=rank,
        world_size=world,
        pid=1000 + rank,
        process_state=state,
        native=any(f.native for t in threads for f in t.frames),
        threads=tuple(threads),
        native_threads=tuple(native_threads),
        error=error,
    )


def common(*inner: Frame) -> list[Frame]:
    """A training loop's outer frames, then `inner`."""
    return [py("<module>", 90), py("main", 80), py("train_step", 40), *inner]


def verdict(
    incident_id: str,
    world: int,
    *,
    node: str = "node-a",
    kind: str = "hang",
    culprit: int | None = None,
    detected_at: str = "2026-11-21T23:59:01Z",
) -> dict:
    return {
        "format": "diag.verdict/1",
        "incident_id": incident_id,
        "kind": kind,
        "node": node,
        "job": "job-1",
        "world_size": world,
        "detected_at": detected_at,
        "culprit": culprit,
        "suspects": [],
        "summary": f"test verdict for {incident_id}",
        "future_field": {"ignored": True},
    }


def write_incident(
    directory: Path, dumps: Iterable[RankDump], verdict_doc: dict | None = None
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for d in dumps:
        (directory / d.file_name).write_text(d.to_json())
    if verdict_doc is not None:
        (directory / "verdict.json").write_text(json.dumps(verdict_doc))
    return directory


def odd_one_out(world: int, odd: int) -> list[RankDump]:
    """`world` ranks waiting in a barrier, but `odd` stuck loading a checkpoint."""
    out = []
    for r in range(world):
        inner = (
            [py("load_checkpoint", 12), native("read")]
            if r == odd
            else [py("barrier", 4811, C10D), native("futex_wait")]
        )
        out.append(rank_dump(r, world, thread(common(*inner))))
    return out


F = descriptor_pb2.FieldDescriptorProto


def _stacktrace_class():
    """xpu_timer's Stacktrace message (the fields we read), built with the real protobuf
    library from a descriptor, to produce the bytes xpu_timer writes."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="xpu_test_hosting.proto", package="xpu_timer.server", syntax="proto3"
    )

    def message(name, *fields):
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, repeated, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype)
            f.label = F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL
            if type_name:
                f.type_name = f".xpu_timer.server.{type_name}"

    s, msg = F.TYPE_STRING, F.TYPE_MESSAGE
    message(
        "PySpyFrame",
        ("func_name", 1, s, False, ""),
        ("file_name", 2, s, False, ""),
        ("module", 3, s, False, ""),
    )
    message(
        "PySpyStacktrace",
        ("pid", 1, F.TYPE_UINT32, False, ""),
        ("thread_id", 2, F.TYPE_UINT64, False, ""),
        ("thread_name", 3, s, False, ""),
        ("os_thread_id", 4, F.TYPE_UINT32, False, ""),
        ("active", 5, F.TYPE_BOOL, False, ""),
        ("owns_gil", 6, F.TYPE_BOOL, False, ""),
        ("frames", 7, msg, True, "PySpyFrame"),
    )
    message(
        "PstackFrame",
        ("func_name", 1, s, False, ""),
        ("file_name", 2, s, False, ""),
        ("origin", 3, s, False, ""),
    )
    message(
        "PstackStacktrace",
        ("pid", 1, F.TYPE_UINT32, False, ""),
        ("thread_name", 2, s, False, ""),
        ("frames", 3, msg, True, "PstackFrame"),
    )
    message(
        "DeviceStatus", ("block_range", 1, s, False, ""), ("hang_step", 6, F.TYPE_INT32, False, "")
    )
    message(
        "Stacktrace",
        ("stacktrace", 1, msg, True, "PstackStacktrace"),
        ("py_stacktrace", 2, msg, True, "PySpyStacktrace"),
        ("pid", 3, F.TYPE_INT32, False, ""),
        ("rank", 4, F.TYPE_INT32, False, ""),
        ("pstack_stdout", 5, s, False, ""),
        ("pstack_stderr", 6, s, False, ""),
        ("pyspy_stdout", 7, s, False, ""),
        ("pyspy_stderr", 8, s, False, ""),
        ("device_status", 10, msg, True, "DeviceStatus"),
        ("process_state", 11, s, False, ""),
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("xpu_timer.server.Stacktrace")
    )


Stacktrace = _stacktrace_class()
