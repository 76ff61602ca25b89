"""What a frame is called and what kind it is, in the merged views.

Labels follow xpu_timer's viewer: `func@file:line`, and in the folded output the rank sets are
appended, `func@file:line@<ranks with>|<ranks without>`. Native frames without a line number read
`func@library`. Unresolved native frames (py-spy names them by their address, which differs in
every process) read `??@library`, so that ranks stopped at the same place merge.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from diag.formats.stackdump import ADDRESS, UNRESOLVED, Frame


class FrameKind(enum.StrEnum):
    ROOT = "root"
    ROLE = "role"  # what the threads below are for: training, data loader, logging, ...
    THREAD = "thread"  # the thread a stack belongs to
    STATE = "state"  # process state, error, or "no native stack"
    PYTHON = "py"
    NATIVE = "native"
    TORCH = "torch"  # torch, c10d, NCCL or gloo, Python or native
    OTHER = "other"  # thin frames merged into one cell


@dataclass(frozen=True)
class FrameInfo:
    """How a frame is shown: its label, its cell text and its kind."""

    text: str  # the label without rank sets, e.g. `barrier@/x/distributed_c10d.py:4811`
    short: str  # the cell text: the same with a shortened path
    kind: FrameKind
    native: bool = False


_TORCH = re.compile(r"torch|nccl|gloo|c10d|libc10", re.IGNORECASE)
_UNSAFE = re.compile(r"[;\r\n\t]")  # `;` separates frames in folded stacks
_PKG_ROOTS = ("/site-packages/", "/dist-packages/")
_STDLIB = re.compile(r"/lib/python\d+(\.\d+)?t?/")


def clean(text: str) -> str:
    return _UNSAFE.sub(" ", text)


def short_path(path: str) -> str:
    """A path short enough for a cell: inside a package root or the standard library, the part
    from there on (`torch/distributed/distributed_c10d.py`); else the file name."""
    for root in _PKG_ROOTS:
        i = path.rfind(root)
        if i >= 0:
            return path[i + len(root) :]
    ends = [m.end() for m in _STDLIB.finditer(path)]
    if ends:
        return path[ends[-1] :]
    return path.rsplit("/", 1)[-1]


def frame_info(frame: Frame) -> FrameInfo:
    func = frame.func or "?"
    if frame.native and ADDRESS.match(func):
        func = UNRESOLVED
    where = frame.file or frame.module
    kind = FrameKind.NATIVE if frame.native else FrameKind.PYTHON
    if _TORCH.search(where) or _TORCH.search(func) or _TORCH.search(frame.module):
        kind = FrameKind.TORCH
    if frame.line > 0:
        text = f"{func}@{where}:{frame.line}"
        short = f"{func}@{short_path(where)}:{frame.line}"
    elif where:
        text = f"{func}@{where}"
        short = f"{func}@{where.rsplit('/', 1)[-1]}"
    else:
        text = short = func
    return FrameInfo(text=clean(text), short=clean(short), kind=kind, native=frame.native)


def is_unresolved(info: FrameInfo) -> bool:
    return info.native and (info.text == UNRESOLVED or info.text.startswith(UNRESOLVED + "@"))


def unresolved_run(info: FrameInfo, n: int) -> FrameInfo:
    """One frame standing for `n` consecutive unresolved frames of one library."""
    where = info.text[len(UNRESOLVED) + 1 :]
    short = info.short[len(UNRESOLVED) + 1 :]
    tag = f"{UNRESOLVED} x{n}"
    return FrameInfo(
        text=f"{tag}@{where}" if where else tag,
        short=f"{tag}@{short}" if short else tag,
        kind=info.kind,
        native=True,
    )


def thread_info(name: str) -> FrameInfo:
    text = clean(f"Thread@{name or '?'}")
    return FrameInfo(text=text, short=text, kind=FrameKind.THREAD)


def role_info(role: str) -> FrameInfo:
    text = clean(f"Role@{role}")
    return FrameInfo(text=text, short=text, kind=FrameKind.ROLE)


def state_info(what: str) -> FrameInfo:
    text = clean(f"State@{what}")
    # the cell shows what alone: a silent node's tower is narrow, its label must start at once
    return FrameInfo(text=text, short=clean(what) or text, kind=FrameKind.STATE)


ROOT_INFO = FrameInfo(text="all", short="all", kind=FrameKind.ROOT)
