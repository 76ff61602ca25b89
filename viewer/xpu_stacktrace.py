"""Reads xpu_timer's per-rank `.stacktrace` files (a serialized `xpu_timer.server.Stacktrace`).

Decoded by hand from the protobuf wire format: we read a handful of fields, and a generated
module would tie us to one protobuf runtime. Field numbers (from xpu_timer's
hosting_service.proto):

    Stacktrace        1 stacktrace: PstackStacktrace*   2 py_stacktrace: PySpyStacktrace*
                      3 pid  4 rank  7 pyspy_stdout  8 pyspy_stderr  6 pstack_stderr
                      11 process_state
    PstackStacktrace  1 pid (the LWP)  2 thread_name  3 frames: PstackFrame*
    PstackFrame       1 func_name  2 file_name ("??", a library, or "file.c:741")  3 origin
    PySpyStacktrace   1 pid  2 thread_id  3 thread_name  4 os_thread_id  5 active  6 owns_gil
                      7 frames: PySpyFrame*
    PySpyFrame        1 func_name  2 file_name ("path:line")  3 module ("unknown" if none)

Both kinds of stacks list frames innermost first; ours are root first. xpu_timer runs py-spy
without --native and gdb (pstack) for native stacks, so the Python stacks go to
`RankDump.threads` and the gdb ones to `RankDump.native_threads`.
"""

from __future__ import annotations

from collections.abc import Iterator

from diag.viewer.stacks import Frame, FrameInterner, RankDump, ThreadStack, parse_pyspy_json

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of one message, in order."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == VARINT:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == LENGTH:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise WireError("truncated length-delimited field")
            yield number, wire, buf[pos : pos + n]
            pos += n
        elif wire == FIXED64:
            pos += 8
        elif wire == FIXED32:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        if pos > end:
            raise WireError("truncated fixed-size field")


def _int32(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(value: int | bytes) -> str:
    if isinstance(value, int):
        raise WireError("expected a string, got a number")
    return value.decode("utf-8", "replace")


def _split_line(file_name: str) -> tuple[str, int]:
    path, sep, line = file_name.rpartition(":")
    if sep and line.isdigit():
        return path, int(line)
    return file_name, 0


def _pyspy_thread(buf: bytes, interner: FrameInterner) -> ThreadStack:
    tid = os_tid = 0
    name = ""
    active = owns_gil = False
    frames: list[Frame] = []
    for number, wire, value in fields(buf):
        if number == 2 and wire == VARINT:
            tid = int(value)  # type: ignore[arg-type]
        elif number == 3 and wire == LENGTH:
            name = _text(value)
        elif number == 4 and wire == VARINT:
            os_tid = int(value)  # type: ignore[arg-type]
        elif number == 5 and wire == VARINT:
            active = bool(value)
        elif number == 6 and wire == VARINT:
            owns_gil = bool(value)
        elif number == 7 and wire == LENGTH:
            func = file_name = module = ""
            for n, w, v in fields(value):  # type: ignore[arg-type]
                if w != LENGTH:
                    continue
                if n == 1:
                    func = _text(v)
                elif n == 2:
                    file_name = _text(v)
                elif n == 3:
                    module = _text(v)
            native = module not in ("", "unknown")
            path, line = _split_line(file_name)
            frames.append(interner.frame(func, path, line, native, module if native else ""))
    return ThreadStack(
        tid=tid,
        os_tid=os_tid,
        name=name,
        frames=interner.stack(frames[::-1]),
        active=active,
        owns_gil=owns_gil,
    )


def _pstack_thread(buf: bytes, interner: FrameInterner) -> ThreadStack:
    lwp = 0
    name = ""
    frames: list[Frame] = []
    for number, wire, value in fields(buf):
        if number == 1 and wire == VARINT:
            lwp = int(value)  # type: ignore[arg-type]
        elif number == 2 and wire == LENGTH:
            name = _text(value)
        elif number == 3 and wire == LENGTH:
            func = file_name = ""
            for n, w, v in fields(value):  # type: ignore[arg-type]
                if w == LENGTH and n == 1:
                    func = _text(v)
                elif w == LENGTH and n == 2:
                    file_name = _text(v)
            path, line = _split_line(file_name)
            if path == "??":
                path = ""
            module = path if ".so" in path.rsplit("/", 1)[-1] else ""
            frames.append(interner.frame(func or "??", path, line, True, module))
    return ThreadStack(tid=lwp, os_tid=lwp, name=name, frames=interner.stack(frames[::-1]))


def parse_stacktrace(
    data: bytes, rank: int, world_size: int, interner: FrameInterner | None = None
) -> RankDump:
    """One rank's `.stacktrace` file as a RankDump. Rank and world size come from the file name
    (`{rank:05d}-{world:05d}.stacktrace`), as in xpu_timer's own viewer."""
    interner = interner or FrameInterner()
    py: list[ThreadStack] = []
    native: list[ThreadStack] = []
    pid = 0
    state = pyspy_stdout = ""
    errors: list[str] = []
    for number, wire, value in fields(data):
        if number == 1 and wire == LENGTH:
            native.append(_pstack_thread(value, interner))  # type: ignore[arg-type]
        elif number == 2 and wire == LENGTH:
            py.append(_pyspy_thread(value, interner))  # type: ignore[arg-type]
        elif number == 3 and wire == VARINT:
            pid = _int32(int(value))  # type: ignore[arg-type]
        elif number == 7 and wire == LENGTH:
            pyspy_stdout = _text(value)
        elif number in (6, 8) and wire == LENGTH:
            errors.append(_text(value).strip())
        elif number == 11 and wire == LENGTH:
            state = _text(value)
    if not py and pyspy_stdout:
        # xpu_timer keeps py-spy's raw output when it could not parse it; we may do better.
        try:
            py = list(parse_pyspy_json(pyspy_stdout, interner))
        except (ValueError, TypeError, KeyError, AttributeError):
            errors.append("py-spy output kept raw by xpu_timer is not py-spy JSON either")
    error = ""
    if not py and not native and not state.startswith("D"):
        error = next((e for e in errors if e), "") or "no stack in the .stacktrace file"
    return RankDump(
        rank=rank,
        world_size=world_size,
        pid=pid,
        process_state=state,
        native=False,
        threads=tuple(py),
        native_threads=tuple(native),
        error=error,
    )
