"""Label format, rank folding, frame naming and the dump file format of `diag merge`."""

from __future__ import annotations

import json

import pytest
from mergekit import APP, native, py, rank_dump, thread

from diag.formats.stackdump import Frame, FrameInterner, RankDump, parse_pyspy_json
from diag.viewer import ranksets
from diag.viewer.folded import folded_lines
from diag.viewer.labels import FrameKind, frame_info, short_path
from diag.viewer.tree import View, build_tree


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([], ""),
        ([3], "3"),
        ([0, 1, 2, 5, 6, 7], "0-2/5-7"),
        ([0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11], "0-5/7-11"),
        ([6], "6"),
        ([1, 3, 5], "1/3/5"),
        ([0, 16383], "0/16383"),
        (range(16384), "0-16383"),
    ],
)
def test_fold_ranks(ranks, text):
    assert ranksets.fold_ranks(ranks) == text
    assert ranksets.ranks_of(ranksets.parse(text)) == sorted(ranks)


@pytest.mark.parametrize(
    ("ranks", "limit", "text"),
    [
        (range(0, 40, 4), 3, "0/4/...(+8)"),
        (range(0, 40, 4), 10, "0/4/8/12/16/20/24/28/32/36"),
        (range(0, 40, 4), 9, "0/4/8/12/16/20/24/28/...(+2)"),
        ([*range(0, 5), 9, *range(20, 30)], 2, "0-4/...(+11)"),
        ([7], 1, "7"),
    ],
)
def test_fold_abbreviates_long_lists(ranks, limit, text):
    assert ranksets.fold_ranks(ranks, limit) == text


def test_with_without_against_present_ranks():
    rt = ranksets.RankText(present=ranksets.bits_of(range(12)))
    assert rt.with_without(ranksets.bits_of([*range(6), *range(7, 12)])) == "0-5/7-11|6"
    assert rt.with_without(ranksets.bits_of(range(12))) == "0-11|"
    # ranks without a dump are neither "with" nor "without"
    rt = ranksets.RankText(present=ranksets.bits_of([0, 1, 2, 5]))
    assert rt.with_without(ranksets.bits_of([0, 5])) == "0/5|1-2"


def test_parse_rejects_bad_ranges():
    with pytest.raises(ValueError):
        ranksets.parse("5-3")
    with pytest.raises(ValueError):
        ranksets.bits_of([-1])


@pytest.mark.parametrize(
    ("frame", "text", "short", "kind"),
    [
        (py("train_step", 40), f"train_step@{APP}:40", "train_step@train.py:40", FrameKind.PYTHON),
        (
            py(
                "barrier",
                4811,
                "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
            ),
            "barrier@/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:4811",
            "barrier@torch/distributed/distributed_c10d.py:4811",
            FrameKind.TORCH,
        ),
        (
            py("wait", 327, "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py"),
            "wait@/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py:327",
            "wait@threading.py:327",
            FrameKind.PYTHON,
        ),
        (
            native("0x7f9c99aa3f16"),
            "??@/usr/lib/x86_64-linux-gnu/libc.so.6",
            "??@libc.so.6",
            FrameKind.NATIVE,
        ),
        (
            native("ncclProxyProgress", "/usr/lib/libnccl.so.2"),
            "ncclProxyProgress@/usr/lib/libnccl.so.2",
            "ncclProxyProgress@libnccl.so.2",
            FrameKind.TORCH,
        ),
        (
            native("c10d::ProcessGroupGloo::runLoop", "/opt/lib/libtorch_cpu.so"),
            "c10d::ProcessGroupGloo::runLoop@/opt/lib/libtorch_cpu.so",
            "c10d::ProcessGroupGloo::runLoop@libtorch_cpu.so",
            FrameKind.TORCH,
        ),
        (
            Frame("PyEval_EvalFrame", "/src/Python/ceval.c", 741, native=True),
            "PyEval_EvalFrame@/src/Python/ceval.c:741",
            "PyEval_EvalFrame@ceval.c:741",
            FrameKind.NATIVE,
        ),
        (py("odd;name\nx", 3), f"odd name x@{APP}:3", "odd name x@train.py:3", FrameKind.PYTHON),
    ],
)
def test_frame_labels(frame, text, short, kind):
    info = frame_info(frame)
    assert (info.text, info.short, info.kind) == (text, short, kind)


def test_short_path():
    assert (
        short_path("/a/b/site-packages/deepspeed/runtime/engine.py")
        == "deepspeed/runtime/engine.py"
    )
    assert short_path("/usr/lib/python3.11/json/decoder.py") == "json/decoder.py"
    assert short_path("/srv/app/train.py") == "train.py"


def test_folded_labels_follow_xpu_timer():
    """`func@file:line@<ranks with>|<ranks without>`, consecutive ranks folded, one line per
    place where stacks end, counted in ranks."""
    world = 12
    dumps = []
    for r in range(world):
        leaf = py("odd", 7) if r == 6 else py("wait", 9)
        dumps.append(rank_dump(r, world, thread([py("main", 1), leaf])))
    lines = list(folded_lines(build_tree(dumps, View.PY, world)))
    s = f"Role@training@0-11|;Thread@MainThread@0-11|;main@{APP}:1@0-11|;"
    assert sorted(lines) == sorted(
        [
            s + f"wait@{APP}:9@0-5/7-11|6;State@S (sleeping)@0-5/7-11|6 11\n",
            s + f"odd@{APP}:7@6|0-5/7-11;State@S (sleeping)@6|0-5/7-11 1\n",
        ]
    )


def test_dump_roundtrip_with_native_threads_and_interning():
    d = rank_dump(
        3,
        8,
        thread([py("main", 1), py("f", 2)]),
        native_threads=[thread([native("start_thread"), native("epoll_wait")], name="python")],
    )
    interner = FrameInterner()
    back = RankDump.from_dict(json.loads(d.to_json()), interner)
    assert back == d
    again = RankDump.from_dict(json.loads(d.to_json()), interner)
    # identical stacks of two reads are one shared object
    assert again.threads[0].frames is back.threads[0].frames
    assert again.native_threads[0].frames[0] is back.native_threads[0].frames[0]


def test_old_dump_without_native_threads_still_loads():
    raw = json.loads(rank_dump(0, 2, thread([py("main", 1)])).to_json())
    del raw["native_threads"]
    for f in raw["threads"][0]["frames"]:
        del f["module"]
    assert RankDump.from_dict(raw).threads[0].frames == (py("main", 1),)


def test_parse_pyspy_json_native_order():
    text = json.dumps(
        [
            {
                "pid": 7,
                "thread_id": 11,
                "thread_name": "MainThread",
                "os_thread_id": 7,
                "active": False,
                "owns_gil": False,
                "frames": [
                    {
                        "name": "clock_nanosleep",
                        "filename": "/lib/libc.so.6",
                        "module": "/lib/libc.so.6",
                        "line": 0,
                    },
                    {"name": "main", "filename": APP, "module": None, "line": 5},
                ],
            }
        ]
    )
    (t,) = parse_pyspy_json(text)
    assert [f.func for f in t.frames] == ["main", "clock_nanosleep"]
    assert [f.native for f in t.frames] == [False, True]
