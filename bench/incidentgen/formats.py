"""Projections of a rank's thread model into the three formats `diag merge` reads: `diag.stack/1`
JSON, raw `py-spy dump --json --native` output and xpu_timer's `.stacktrace` protobuf."""

from __future__ import annotations

import random
from dataclasses import dataclass

from diag.proto import hosting_service_pb2 as xpu_pb2

from .model import CEVAL, LIBPY, F, RankPlan, ThreadModel, c
from .native import native_only
from .threads import python_threads

# gdb shows these interpreter frames for every Python frame (3.11: one C eval frame runs several
# Python frames; we keep it simple and regular).
_EVAL = (
    c("_PyEval_EvalFrameDefault", LIBPY, f"{CEVAL}:5333"),
    c("_PyEval_EvalFrame", LIBPY, "./Include/internal/pycore_ceval.h:73"),
    c("_PyEval_Vector", LIBPY, f"{CEVAL}:6434"),
    c("_PyFunction_Vectorcall", LIBPY, "Objects/call.c:393"),
    c("_PyObject_VectorcallTstate", LIBPY, "./Include/internal/pycore_call.h:92"),
    c("PyObject_Vectorcall", LIBPY, "Objects/call.c:299"),
)


def gdb_frames(frames: tuple[F, ...]) -> list[F]:
    """gdb's view of a thread, root first: each Python frame becomes the interpreter's frames."""
    out: list[F] = []
    for f in frames:
        if f.native:
            out.append(f)
        else:
            out.extend(_EVAL)
    return out


class Addresses:
    """Load addresses of a process's libraries (ASLR: they differ per process), for the hex
    addresses py-spy prints for unresolved frames and gdb prints on every line."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.base: dict[str, int] = {}

    def of(self, lib: str, index: int) -> int:
        b = self.base.get(lib)
        if b is None:
            b = self.base[lib] = 0x7F0000000000 + self.rng.randrange(1 << 28) * 0x1000
        return b + 0x1000 + index * 0x1F3

    def heap(self, index: int) -> int:
        """A pointer into the process's heap, as gdb prints among a frame's arguments."""
        b = self.base.get("[heap]")
        if b is None:
            b = self.base["[heap]"] = 0x550000000000 + self.rng.randrange(1 << 28) * 0x1000
        return b + index * 0x2A8


def pyspy_frames(frames: tuple[F, ...], addr: Addresses) -> list[dict]:
    """`py-spy dump --json --native` frames, innermost first: Python frames and native ones
    interleaved, unresolved ones as hex addresses."""
    out = []
    for i, f in enumerate(reversed(frames)):
        if f.native:
            name = f.func if f.func != "??" else hex(addr.of(f.lib, i))
            short = f.lib.rsplit("/", 1)[-1]
            out.append(
                {
                    "name": name,
                    "filename": f.lib,
                    "module": f.lib,
                    "short_filename": short,
                    "line": 0,
                    "locals": None,
                }
            )
        else:
            out.append(
                {
                    "name": f.func,
                    "filename": f.file,
                    "module": None,
                    "short_filename": f.file.rsplit("/", 1)[-1],
                    "line": f.line,
                    "locals": None,
                }
            )
    return out


def diag_frames(frames: list[F] | tuple[F, ...], native: bool) -> list[dict]:
    """`diag.stack/1` frames, root first."""
    out = []
    for f in frames:
        if f.native:
            if not native:
                continue
            out.append({"func": f.func, "file": f.lib, "line": 0, "native": True, "module": f.lib})
        else:
            out.append(
                {"func": f.func, "file": f.file, "line": f.line, "native": False, "module": ""}
            )
    return out


# gdb prints the arguments of frames it has debug information for (those with a source line):
# pointers among them differ in every process. Python's evaluation frames are most of a thread.
_GDB_ARGS = {
    "_PyEval_EvalFrameDefault": "tstate=0x{a:x}, frame=0x{b:x}, throwflag=<optimized out>",
    "_PyEval_EvalFrame": "tstate=0x{a:x}, frame=0x{b:x}, throwflag=0",
    "_PyEval_Vector": "tstate=0x{a:x}, func=0x{b:x}, locals=locals@entry=0x0, args=0x{c:x},"
    " argcount=<optimized out>, kwnames=<optimized out>",
    "_PyFunction_Vectorcall": "func=0x{b:x}, stack=0x{c:x}, nargsf=<optimized out>,"
    " kwnames=<optimized out>",
    "_PyObject_VectorcallTstate": "kwnames=0x0, nargsf=9223372036854775809, args=0x{c:x},"
    " callable=0x{b:x}, tstate=0x{a:x}",
    "PyObject_Vectorcall": "callable=0x{b:x}, args=0x{c:x}, nargsf=<optimized out>,"
    " kwnames=<optimized out>",
}
_GDB_ARGS_DEFAULT = "self=0x{b:x}, args=0x{c:x}, kwargs=<optimized out>"


def _gdb_line(n: int, f: F, address: int, addr: Addresses) -> str:
    where = f" at {f.src}" if f.src else (f" from {f.lib}" if f.lib else "")
    args = ""
    if f.src:
        fmt = _GDB_ARGS.get(f.func, _GDB_ARGS_DEFAULT)
        args = fmt.format(a=addr.heap(0), b=addr.heap(3 * n + 1), c=addr.heap(3 * n + 2))
    return f"#{n:<3}0x{address:016x} in {f.func} ({args}){where}"


@dataclass
class RankThreads:
    """One rank's threads with its ids: (model, python tid, os tid)."""

    pid: int
    threads: list[tuple[ThreadModel, int, int]]


def rank_threads(plan: RankPlan, rng: random.Random) -> RankThreads:
    pid = 1000 + rng.randrange(60000)
    models = python_threads(plan, rng) + native_only(rng)
    out = []
    for i, m in enumerate(models):
        lwp = pid if i == 0 else pid + 7 + i * 3 + rng.randrange(3)
        tid = 0x7F0000000000 + rng.randrange(1 << 30) * 0x1000 if m.py else 0
        out.append((m, tid, lwp))
    return RankThreads(pid, out)


def diag_dump(rt: RankThreads, rank: int, world: int, local: int, state: str) -> dict:
    threads, native_threads = [], []
    for m, tid, lwp in rt.threads:
        if m.py:
            threads.append(
                {
                    "tid": tid,
                    "os_tid": lwp,
                    "name": m.name,
                    "frames": diag_frames(m.frames, True),
                    "active": False,
                    "owns_gil": False,
                }
            )
        native_threads.append(
            {
                "tid": lwp,
                "os_tid": lwp,
                "name": m.comm,
                "frames": diag_frames(gdb_frames(m.frames), True),
                "active": False,
                "owns_gil": False,
            }
        )
    return {
        "rank": rank,
        "world_size": world,
        "pid": rt.pid,
        "node": f"node-{rank // local:04d}",
        "local_rank": rank % local,
        "process_state": state,
        "native": True,
        "captured_at": "2026-11-23T04:12:09Z",
        "capture_seconds": 0.74,
        "threads": threads,
        "error": "",
        "format": "diag.stack/1",
        "native_threads": native_threads,
    }


def pyspy_dump(rt: RankThreads, addr: Addresses) -> list[dict]:
    return [
        {
            "pid": rt.pid,
            "thread_id": tid,
            "thread_name": m.name,
            "os_thread_id": lwp,
            "active": False,
            "owns_gil": False,
            "frames": pyspy_frames(m.frames, addr),
        }
        for m, tid, lwp in rt.threads
        if m.py
    ]


def xpu_dump(rt: RankThreads, rank: int, state: str, addr: Addresses) -> bytes:
    st = xpu_pb2.Stacktrace(pid=rt.pid, rank=rank, process_state=state)
    # gdb lists threads newest first
    for m, _tid, lwp in reversed(rt.threads):
        t = st.stacktrace.add(pid=lwp, thread_name=m.comm)
        for n, f in enumerate(reversed(gdb_frames(m.frames))):
            file_name = f.src or f.lib or "??"
            t.frames.add(
                func_name=f.func,
                file_name=file_name,
                origin=_gdb_line(n, f, addr.of(f.lib or "-", n), addr),
            )
    for m, tid, lwp in rt.threads:
        if not m.py:
            continue
        t = st.py_stacktrace.add(pid=rt.pid, thread_id=tid, thread_name=m.name, os_thread_id=lwp)
        for f in reversed(m.frames):
            if not f.native:  # xpu_timer runs py-spy without --native
                t.frames.add(func_name=f.func, file_name=f"{f.file}:{f.line}", module="unknown")
    return st.SerializeToString()


def folded_lines(rt: RankThreads, state: str) -> tuple[list[str], list[str]]:
    """The rank's threads as flamegraph.pl's folded input, one line per thread: the Python view
    (the Python threads' Python frames) and the native view (every thread as gdb shows it). The
    bench gives flamegraph.pl these to merge and draw the same stacks `diag merge` does."""
    py, cpp = [], []
    for m, _tid, _lwp in rt.threads:
        head = f"State@{state};Thread@{m.name or m.comm}"
        if m.py:
            frames = (f"{f.func}@{f.file}:{f.line}" for f in m.frames if not f.native)
            py.append(";".join((head, *frames)) + " 1\n")
        frames = (f"{f.func}@{f.src or f.lib}" for f in gdb_frames(m.frames))
        cpp.append(";".join((head, *frames)) + " 1\n")
    return py, cpp
