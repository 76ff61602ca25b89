"""Inputs of `diag merge`: our dumps, raw py-spy JSON and xpu_timer's protobuf `.stacktrace`
files, mixed in one incident; unreadable files; files that are no dumps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mergekit import APP, Stacktrace, common, native, py, rank_dump, thread, write_incident

from diag.formats.stackdump import FrameInterner
from diag.viewer.merge import merge_incident
from diag.viewer.sources import DumpFormat, dump_files, load_dump, load_dumps
from diag.viewer.xpu_stacktrace import StacktraceError, parse_stacktrace


def xpu_bytes(rank: int, py_frames: list[tuple[str, str]], state: str = "S (sleeping)") -> bytes:
    """As xpu_timer's dump driver writes them: frames innermost first, `file:line`."""
    st = Stacktrace(pid=4000 + rank, rank=rank, process_state=state)
    t = st.py_stacktrace.add(
        pid=4000 + rank, thread_id=2**40 + rank, thread_name="MainThread", os_thread_id=4000 + rank
    )
    for func, file_line in reversed(py_frames):
        t.frames.add(func_name=func, file_name=file_line, module="unknown")
    g = st.stacktrace.add(pid=4000 + rank, thread_name="python")
    for func, file_name in [
        ("pthread_cond_wait@@GLIBC_2.3.2", "/usr/lib64/libpthread.so.0"),
        ("PyEval_EvalFrameEx", "/usr/local/src/conda/python-3.8.18/Python/ceval.c:741"),
        ("main", "??"),
    ]:
        g.frames.add(func_name=func, file_name=file_name, origin=f"#0 0x0 in {func}")
    st.device_status.add(block_range="0-0", hang_step=-1)  # a field we skip
    return st.SerializeToString()


def test_stacktrace_decodes_bytes_from_the_protobuf_library():
    data = xpu_bytes(3, [("<module>", f"{APP}:90"), ("main", f"{APP}:80"), ("barrier", f"{APP}:4")])
    d = parse_stacktrace(data, 3, 8)
    assert (d.rank, d.world_size, d.pid, d.process_state, d.error) == (
        3,
        8,
        4003,
        "S (sleeping)",
        "",
    )
    (t,) = d.threads
    assert t.name == "MainThread" and t.tid == 2**40 + 3
    assert [(f.func, f.file, f.line, f.native) for f in t.frames] == [
        ("<module>", APP, 90, False),
        ("main", APP, 80, False),
        ("barrier", APP, 4, False),
    ]
    (g,) = d.native_threads
    assert [(f.func, f.file, f.line) for f in g.frames] == [
        ("main", "", 0),
        ("PyEval_EvalFrameEx", "/usr/local/src/conda/python-3.8.18/Python/ceval.c", 741),
        ("pthread_cond_wait@@GLIBC_2.3.2", "/usr/lib64/libpthread.so.0", 0),
    ]
    assert all(f.native for f in g.frames)


def test_stacktrace_negative_int32_and_d_state_and_raw_pyspy_fallback():
    st = Stacktrace(pid=-5, process_state="D (disk sleep)")
    d = parse_stacktrace(st.SerializeToString(), 1, 2)
    assert (d.pid, d.process_state, d.threads, d.error) == (-5, "D (disk sleep)", (), "")
    raw = json.dumps(
        [
            {
                "thread_name": "MainThread",
                "thread_id": 1,
                "frames": [{"name": "f", "filename": APP, "line": 3}],
            }
        ]
    )
    st = Stacktrace(pyspy_stdout=raw, pyspy_stderr="Traceback ...: KeyError 'pid'")
    d = parse_stacktrace(st.SerializeToString(), 0, 2)
    assert [f.func for f in d.threads[0].frames] == ["f"] and d.error == ""
    d = parse_stacktrace(
        Stacktrace(pyspy_stderr="py-spy: permission denied").SerializeToString(), 0, 2
    )
    assert d.error == "py-spy: permission denied"


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x08", b"\x0b\x00", b"\x00\x01"])
def test_stacktrace_rejects_broken_bytes(data):
    with pytest.raises(StacktraceError):
        parse_stacktrace(data, 0, 1)


def pyspy_json(frames: list[tuple[str, str, int, str | None]]) -> str:
    """`py-spy dump --json --native` output: frames innermost first."""
    return json.dumps(
        [
            {
                "pid": 77,
                "thread_id": 123,
                "thread_name": "MainThread",
                "os_thread_id": 77,
                "active": False,
                "owns_gil": False,
                "frames": [
                    {
                        "name": n,
                        "filename": f,
                        "module": m,
                        "short_filename": f,
                        "line": line,
                        "locals": None,
                    }
                    for n, f, line, m in reversed(frames)
                ],
                "process_info": None,
            }
        ],
        indent=2,
    )


def test_mixed_inputs_merge_into_one_picture(tmp_path: Path):
    """Ranks 0-1 as our dumps, 2-3 as raw py-spy JSON, 4-5 as xpu_timer files: all waiting in
    `barrier`, except rank 4 (an xpu_timer file) stuck in `load_checkpoint`."""
    world = 6
    d = tmp_path / "timeline"
    write_incident(d, [rank_dump(r, world, thread(common(py("barrier", 4)))) for r in (0, 1)])
    for r in (2, 3):
        frames = [
            ("<module>", APP, 90, None),
            ("main", APP, 80, None),
            ("train_step", APP, 40, None),
        ]
        frames += [("barrier", APP, 4, None), ("futex_wait", "/lib/libc.so.6", 0, "/lib/libc.so.6")]
        name = f"{r:05d}-{world:05d}" + (".json" if r == 2 else ".pyspy.json")
        (d / name).write_text(pyspy_json(frames))
    for r in (4, 5):
        leaf = ("load_checkpoint", f"{APP}:12") if r == 4 else ("barrier", f"{APP}:4")
        frames = [
            ("<module>", f"{APP}:90"),
            ("main", f"{APP}:80"),
            ("train_step", f"{APP}:40"),
            leaf,
        ]
        (d / f"{r:05d}-{world:05d}.stacktrace").write_bytes(xpu_bytes(r, frames))
    # neither of these is a dump
    (d / f"{0:05d}-{world:05d}.journal.json").write_text('{"records": []}')
    (d / f"{1:05d}-{world:05d}.flight.json").write_text('{"not": "py-spy"}')
    (d / "machine.json").write_text("{}")

    files = dump_files(d)
    assert [(f.rank, f.format) for f in files] == [
        (0, DumpFormat.DIAG),
        (1, DumpFormat.DIAG),  # .stack.json wins over the .flight.json of the same rank
        (2, DumpFormat.PYSPY),
        (3, DumpFormat.PYSPY),
        (4, DumpFormat.XPU_TIMER),
        (5, DumpFormat.XPU_TIMER),
    ]
    result = merge_incident(d)
    assert result.ranks == "0-5"
    assert [s.rank for s in result.suspects] == [4]
    py_classes = result.classes[next(iter(result.classes))]
    assert [(c.size, c.ranks) for c in py_classes] == [(5, "0-3/5"), (1, "4")]
    summary = json.loads(result.summary_json.read_text())
    assert summary["dump_formats"] == {
        "diag.stack/1": 2,
        "py-spy JSON": 2,
        "xpu_timer .stacktrace": 2,
    }
    assert summary["suspect_ranks"] == "4"
    folded = result.folded[next(iter(result.folded))].read_text()
    # ranks 2-3 (raw py-spy) have no known process state: their stacks end without a cap
    assert f";barrier@{APP}:4@0-3/5|4 2\n" in folded
    assert f";barrier@{APP}:4@0-3/5|4;State@S (sleeping)@0-1/5|2-4 3\n" in folded
    assert f";load_checkpoint@{APP}:12@4|0-3/5;State@S (sleeping)@4|0-3/5 1\n" in folded
    # the native view: py-spy --native frames for 2-3, gdb stacks for 4-5, none for 0-1
    cpp = result.report.views[1]
    assert cpp.view.value == "cpp"
    cpp_folded = (result.out_dir / cpp.folded).read_text()
    assert "State@no native stack@0-1|2-5" in cpp_folded
    assert "pthread_cond_wait@@GLIBC_2.3.2@/usr/lib64/libpthread.so.0@4-5|0-3" in cpp_folded
    assert "futex_wait@/lib/libc.so.6@2-3|0-1/4-5" in cpp_folded


def test_unreadable_files_show_as_failed_ranks(tmp_path: Path):
    world = 4
    d = write_incident(
        tmp_path / "inc", [rank_dump(r, world, thread(common(py("barrier", 4)))) for r in (0, 1)]
    )
    (d / "00002-00004.stack.json").write_text('{"format": "diag.stack/1", "rank": 2, "wor')
    (d / "00003-00004.stacktrace").write_bytes(b"\x0a\xff\x01")
    interner = FrameInterner()
    loaded = {f.rank: load_dump(f, interner) for f in dump_files(d)}
    assert "bad JSON" in loaded[2].error and "bad protobuf" in loaded[3].error
    result = merge_incident(d)
    assert result.ranks == "0-3"
    summary = json.loads(result.summary_json.read_text())
    assert [e["rank"] for e in summary["errors"]] == [2, 3]
    # they did not answer: no class of their own, suspects (the ranks that answered agree)
    assert "did not answer: 2 ranks 2-3" in result.summary_txt.read_text()
    assert [(s.rank, s.score) for s in result.suspects] == [(2, 1.0), (3, 1.0)]
    assert "bad protobuf" in result.suspects[1].reasons[0]
    assert (
        "rank 2: no stack: unreadable diag.stack/1 file: bad JSON" in result.summary_txt.read_text()
    )


def test_dump_whose_content_contradicts_its_name(tmp_path: Path):
    d = tmp_path / "inc"
    d.mkdir()
    (d / "00001-00004.stack.json").write_text(rank_dump(2, 4, thread([py("main", 1)])).to_json())
    (f,) = dump_files(d)
    assert "not what its name says" in load_dump(f, FrameInterner()).error


def test_native_frames_of_pyspy_keep_their_library(tmp_path: Path):
    frames = [("main", APP, 80, None), ("0x7f00dead", "/lib/libc.so.6", 0, "/lib/libc.so.6")]
    (tmp_path / "00000-00001.json").write_text(pyspy_json(frames))
    (f,) = dump_files(tmp_path)
    dump = load_dump(f, FrameInterner())
    assert dump.native and dump.threads[0].frames[-1] == native("0x7f00dead", "/lib/libc.so.6")


def test_parallel_loading_gives_the_same_dumps(tmp_path: Path):
    world = 24
    dumps = [rank_dump(r, world, thread(common(py("barrier", r % 3)))) for r in range(world)]
    d = write_incident(tmp_path / "inc", dumps)
    (d / "00023-00024.stack.json").write_text("{broken")
    files = dump_files(d)
    serial = load_dumps(files, workers=1)
    parallel = load_dumps(files, workers=3, parallel_from=1)
    assert parallel == serial
    assert parallel[:23] == dumps[:23] and "bad JSON" in parallel[23].error
