"""Reads xpu_timer's per-rank `.stacktrace` files (a serialized `xpu_timer.server.Stacktrace`)
with the protobuf runtime.

xpu_timer runs py-spy without --native and gdb (pstack) for native stacks, so the Python stacks
go to `RankDump.threads` and the gdb ones to `RankDump.native_threads`. Both list frames
innermost first; ours are root first.

Speed: a rank's file holds ~75 threads and ~1,000 frames, and thousands of ranks hold mostly the
same stacks. Each thread is therefore looked up by its content before its frames are read: the
file is parsed as a reading view of xpu_timer's messages (`diag/proto/stacktrace_view.proto`, the
module generated from it) that leaves out gdb's raw lines (`PstackFrame.origin`, which carry
addresses that differ in every process), the per-process fields of each thread are read and
cleared, and the rest, serialized by the runtime, is the key under which its frames were
converted once. Converting frames one by one in Python is what would cost; the runtime's C
parser and serializer do the rest. (The view is a module of its own, not derived at run time
from `hosting_service.proto`: that would import protobuf's descriptor module, a fifth of a
merge's start-up.)
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from diag.formats.inputcaps import clean, clean_lines
from diag.formats.stackdump import Frame, FrameInterner, RankDump, ThreadStack, parse_pyspy_json
from diag.proto.stacktrace_view_pb2 import Stacktrace as _Stacktrace


class StacktraceError(ValueError):
    """The bytes are no `Stacktrace` message."""


# Fields of a py-spy thread that differ in every process: cleared before the thread's content is
# looked up.
_PY_PER_PROCESS = ("pid", "thread_id", "os_thread_id", "active", "owns_gil")


def _split_line(file_name: str) -> tuple[str, int]:
    path, sep, line = file_name.rpartition(":")
    if sep and line.isdigit():
        return path, int(line)
    return file_name, 0


class StacktraceReader:
    """Reads `.stacktrace` files, converting each distinct thread stack once."""

    def __init__(self, interner: FrameInterner | None = None) -> None:
        self.interner = interner or FrameInterner()
        self._py: dict[bytes, tuple[Frame, ...]] = {}
        self._native: dict[bytes, tuple[Frame, ...]] = {}

    def _py_frames(self, t) -> tuple[Frame, ...]:
        frames = []
        for f in reversed(t.frames):
            native = f.module not in ("", "unknown")
            path, line = _split_line(f.file_name)
            frames.append(
                self.interner.frame(f.func_name, path, line, native, f.module if native else "")
            )
        return self.interner.stack(frames)

    def _native_frames(self, t) -> tuple[Frame, ...]:
        frames = []
        for f in reversed(t.frames):
            path, line = _split_line(f.file_name)
            if path == "??":
                path = ""
            module = path if ".so" in path.rsplit("/", 1)[-1] else ""
            frames.append(self.interner.frame(f.func_name or "??", path, line, True, module))
        return self.interner.stack(frames)

    def read(self, data: bytes, rank: int, world_size: int) -> RankDump:
        """One rank's file as a RankDump. Rank and world size come from the file name
        (`{rank:05d}-{world:05d}.stacktrace`), as in xpu_timer's own viewer."""
        st = _Stacktrace()
        try:
            st.ParseFromString(data)
        except DecodeError as e:
            # the runtime's message names our private reading view: say it plainly
            raise StacktraceError("not a Stacktrace message, or a truncated one") from e
        st.DiscardUnknownFields()
        # The loops below run for every thread of every rank: attribute lookups hoisted.
        py: list[ThreadStack] = []
        seen, clear = self._py, _PY_PER_PROCESS
        for t in st.py_stacktrace:
            tid, os_tid, name = t.thread_id, t.os_thread_id, t.thread_name
            active, owns_gil = t.active, t.owns_gil
            for field in clear:
                t.ClearField(field)
            key = t.SerializeToString()
            frames = seen.get(key)
            if frames is None:
                frames = seen[key] = self._py_frames(t)
            py.append(ThreadStack(tid, os_tid, clean(name), frames, active, owns_gil))
        native: list[ThreadStack] = []
        seen = self._native
        for t in st.stacktrace:
            lwp = t.pid
            t.ClearField("pid")
            key = t.SerializeToString()
            frames = seen.get(key)
            if frames is None:
                frames = seen[key] = self._native_frames(t)
            native.append(ThreadStack(lwp, lwp, clean(t.thread_name), frames))
        errors = [clean_lines(e.strip()) for e in (st.pstack_stderr, st.pyspy_stderr) if e.strip()]
        if not py and st.pyspy_stdout:
            # xpu_timer keeps py-spy's raw output when it could not parse it; we may do better.
            try:
                py = list(parse_pyspy_json(st.pyspy_stdout, self.interner))
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
                errors.append("py-spy output kept raw by xpu_timer is not py-spy JSON either")
        state = clean(st.process_state)
        error = ""
        if not py and not native and not state.startswith("D"):
            error = next(iter(errors), "") or "no stack in the .stacktrace file"
        return RankDump(
            rank=rank,
            world_size=world_size,
            pid=st.pid,
            process_state=state,
            native=False,
            threads=tuple(py),
            native_threads=tuple(native),
            error=error,
        )


def parse_stacktrace(
    data: bytes, rank: int, world_size: int, interner: FrameInterner | None = None
) -> RankDump:
    """One rank's `.stacktrace` file as a RankDump (see StacktraceReader.read)."""
    return StacktraceReader(interner).read(data, rank, world_size)
