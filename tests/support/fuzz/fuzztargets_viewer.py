"""Fuzz targets of `diag merge`'s readers: one rank's dump in each format (diag.stack/1, py-spy
JSON, xpu_timer's .stacktrace), a journal tail and a verdict.json, each through the path the
merge reads them by: the directory scan, `gather` (read, roles, stacks collected), the
analysis (trees, classes, suspects, silent ranks) and the folded text.

A bad dump is no refusal here: the merge reports it per rank and goes on, so it is "accepted"
as long as nothing else than the reader's own errors comes out.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from fuzzkit import FuzzTarget
from mergekit import C10D, Stacktrace, common, native, odd_one_out, py, rank_dump, thread

from diag.formats.untrusted import UntrustedInput
from diag.viewer.analysis import analyse
from diag.viewer.folded import folded_lines
from diag.viewer.gather import gather
from diag.viewer.incidents import IncidentError, find_incidents
from diag.viewer.merge import incident_files
from diag.viewer.sources import scan
from diag.viewer.tree import View

WORLD = 2
DIAG_NAME = "00000-00002.stack.json"
PYSPY_NAME = "00000-00002.json"
XPU_NAME = "00000-00002.stacktrace"
TAIL_NAME = "00000-00002.journal.json"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """A bad dump is reported with a warning each: a hundred thousand of them say nothing."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _read_rank(path: Path) -> object:
    """What the merge does with the dumps of the input's directory, short of writing."""
    with _quiet():
        found = scan(path.parent)
        got = gather(found.files, workers=1)
        result = analyse(got, WORLD, (), None)
        for view in View:
            for _ in folded_lines(result.trees[view]):
                pass
        return result


def _diag_seeds(d: Path) -> list[bytes]:
    one = odd_one_out(WORLD, 0)[0]
    crowded = rank_dump(
        0,
        WORLD,
        thread(common(py("step", 3), native("ncclKernel", "/usr/lib/libnccl.so.2"))),
        thread([py("run", 9, "/usr/lib/python3.11/threading.py")], name="Thread-3", tid=2),
        state="D (disk sleep)",
    )
    return [one.to_json().encode(), crowded.to_json().encode()]


def _pyspy_seeds(d: Path) -> list[bytes]:
    def frame(name: str, file: str, line: int, module: str | None = None) -> dict:
        out: dict = {"name": name, "filename": file, "line": line}
        if module is not None:
            out["module"] = module
        return out

    main = {
        "pid": 4242,
        "thread_id": 140001,
        "thread_name": "MainThread",
        "os_thread_id": 4242,
        "active": False,
        "owns_gil": False,
        "frames": [
            frame("ncclGroupEnd", "", 0, "/usr/lib/libnccl.so.2"),
            frame("barrier", C10D, 4811),
            frame("main", "/srv/app/train.py", 80),
            frame("<module>", "/srv/app/train.py", 90),
        ],
    }
    helper = dict(main, thread_id=140002, thread_name="pin_memory", os_thread_id=4243)
    helper["frames"] = [frame("wait", "/usr/lib/python3.11/threading.py", 320)]
    return [json.dumps([main]).encode(), json.dumps([main, helper]).encode()]


def _xpu_seeds(d: Path) -> list[bytes]:
    st = Stacktrace(pid=4242, rank=0, process_state="S (sleeping)")
    t = st.py_stacktrace.add(pid=4242, thread_id=1, thread_name="MainThread", os_thread_id=4242)
    for name, file in (("main", "/srv/app/train.py:80"), ("barrier", f"{C10D}:4811")):
        t.frames.add(func_name=name, file_name=file, module="")
    n = st.stacktrace.add(pid=4242, thread_name="python")
    n.frames.add(func_name="futex_wait", file_name="/usr/lib/libc.so.6")
    n.frames.add(func_name="??", file_name="??")
    bare = Stacktrace(pid=1, rank=0, pyspy_stderr="Error: Failed to suspend process")
    return [st.SerializeToString(), bare.SerializeToString()]


def _tail_seeds(d: Path) -> list[bytes]:
    (d / DIAG_NAME).write_text(odd_one_out(WORLD, 0)[0].to_json())
    tail = {
        "format": "diag.journal-tail/1",
        "meta": {"local_world_size": 8, "own_threads": [17, 18]},
        "records": [
            {"kind": "op", "seq": 7, "tid": 1, "op": "all_reduce"},
            {"kind": "op", "seq": 8, "tid": 1, "op": "barrier"},
        ],
    }
    return [json.dumps(tail).encode(), json.dumps({"error": "journal gone"}).encode()]


def _verdict_seeds(d: Path) -> list[bytes]:
    (d / DIAG_NAME).write_text(odd_one_out(WORLD, 0)[0].to_json())
    doc = {
        "format": "diag.verdict/1",
        "incident_id": "20261121-235901-hang-node-a",
        "kind": "hang",
        "node": "node-a",
        "job": "job-1",
        "world_size": WORLD,
        "detected_at": "2026-11-21T23:59:01Z",
        "culprit": 1,
        "summary": "rank 1 stopped issuing ops",
    }
    return [json.dumps(doc).encode(), json.dumps(dict(doc, culprit=None)).encode()]


def _read_incident(path: Path) -> object:
    """Discovery of the input's directory as an incident, and its files checked to be of one
    run; then the dumps read as a merge reads them."""
    with _quiet():
        (inc,) = find_incidents(path.parent)
        incident_files(inc)
    return _read_rank(path)


def _clear_dumps(parse):
    """The dump targets write only their own input: a leftover of another target's seeds (same
    rank, another format) would be read instead."""

    def run(path: Path) -> object:
        for other in (DIAG_NAME, PYSPY_NAME, XPU_NAME):
            if other != path.name:
                (path.parent / other).unlink(missing_ok=True)
        return parse(path)

    return run


TARGETS = [
    FuzzTarget(
        "viewer-diag-stack",
        _diag_seeds,
        _clear_dumps(_read_rank),
        file_name=DIAG_NAME,
        json=True,
    ),
    FuzzTarget(
        "viewer-pyspy-json",
        _pyspy_seeds,
        _clear_dumps(_read_rank),
        file_name=PYSPY_NAME,
        json=True,
    ),
    FuzzTarget("viewer-stacktrace", _xpu_seeds, _clear_dumps(_read_rank), file_name=XPU_NAME),
    FuzzTarget("viewer-journal-tail", _tail_seeds, _read_rank, file_name=TAIL_NAME, json=True),
    FuzzTarget(
        "viewer-verdict",
        _verdict_seeds,
        _read_incident,
        refusals=(UntrustedInput, IncidentError),
        file_name="verdict.json",
        json=True,
    ),
]
