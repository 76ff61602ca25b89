"""The pure core of `diag merge`: prefix tree, equivalence classes, suspects, layout, SVG."""

from __future__ import annotations

import random
import re
import xml.etree.ElementTree as ET

import pytest
from mergekit import C10D, common, native, odd_one_out, py, rank_dump, thread

from diag.viewer import ranksets
from diag.viewer.classes import equivalence_classes, suspects
from diag.viewer.flame import FlameHeader, render_svg
from diag.viewer.flamelayout import OTHER, LayoutSettings, layout
from diag.viewer.tree import View, build_tree

SVG = "{http://www.w3.org/2000/svg}"


def node_by_text(tree, text):
    return [i for i, info in enumerate(tree.info) if info.text == text]


def test_width_is_ranks_and_threads_stay_apart():
    world = 6
    dumps = [
        rank_dump(
            r,
            world,
            thread(common(py("barrier", 4811, C10D))),
            thread([py("loop", 3), py("wait", 4)], name="heartbeat", tid=2),
        )
        for r in range(world)
    ]
    tree = build_tree(dumps, View.PY, world)
    (main,) = node_by_text(tree, "Thread@MainThread")
    (beat,) = node_by_text(tree, "Thread@heartbeat")
    assert tree.count[main] == tree.count[beat] == world
    assert tree.bits[main] == tree.bits[beat] == ranksets.bits_of(range(world))
    assert tree.count[0] == 2 * world  # two stacks per rank
    for node in range(1, len(tree)):
        assert tree.count[node] >= sum(tree.count[c] for c in tree.children[node])


def test_same_named_threads_count_as_stacks_of_one_rank():
    dumps = [
        rank_dump(
            r,
            2,
            # two helper threads of one kind: a data loader's queue feeders
            thread([py("work", 1, "/usr/lib/python3.11/multiprocessing/queues.py")], "QF", 1),
            thread([py("work", 1, "/usr/lib/python3.11/multiprocessing/queues.py")], "QF", 2),
        )
        for r in range(2)
    ]
    tree = build_tree(dumps, View.PY, 2)
    (work,) = node_by_text(tree, "work@/usr/lib/python3.11/multiprocessing/queues.py:1")
    assert tree.count[work] == 4
    assert tree.bits[work].bit_count() == 2
    assert equivalence_classes(tree).classes[0].size == 2


def test_views_split_python_and_native_frames():
    d = rank_dump(0, 1, thread([py("main", 1), native("time_sleep"), native("clock_nanosleep")]))
    py_tree, cpp_tree = build_tree([d], View.PY, 1), build_tree([d], View.CPP, 1)
    assert [i.text.split("@")[0] for i in py_tree.info] == [
        "all",
        "Role",
        "Thread",
        "main",
        "State",
    ]
    assert [i.text.split("@")[0] for i in cpp_tree.info][-4:] == [
        "main",
        "time_sleep",
        "clock_nanosleep",
        "State",  # the process state caps each stack
    ]


def test_native_threads_from_another_unwinder_feed_the_cpp_view():
    gdb = thread([native("start_thread"), native("pthread_cond_wait")], name="python")
    with_gdb = rank_dump(0, 2, thread([py("main", 1)]), native_threads=[gdb])
    without = rank_dump(1, 2, thread([py("main", 1)]))
    tree = build_tree([with_gdb, without], View.CPP, 2)
    (cond,) = node_by_text(tree, "pthread_cond_wait@/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert tree.bits[cond] == 0b01
    (none,) = node_by_text(tree, "State@no native stack")
    assert tree.bits[none] == 0b10


def test_rank_without_a_stack_is_its_state_or_error():
    world = 5
    dumps = [rank_dump(r, world, thread(common(py("barrier", 1)))) for r in range(3)]
    dumps.append(rank_dump(3, world, state="D (disk sleep)"))
    dumps.append(rank_dump(4, world, error="py-spy: Failed to suspend process 4711: ESRCH"))
    tree = build_tree(dumps, View.PY, world)
    (d_state,) = node_by_text(tree, "State@D (disk sleep)")
    assert tree.bits[d_state] == 1 << 3 and tree.own[d_state] == 1
    (err,) = node_by_text(tree, "State@error: py-spy: Failed to suspend process N: ESRCH")
    assert tree.bits[err] == 1 << 4
    vc = equivalence_classes(tree)
    assert [c.size for c in vc.classes] == [3, 1, 1]
    assert {c.ranks for c in vc.classes if c.suspect} == {"3", "4"}


@pytest.mark.parametrize(
    ("sizes", "suspect"),
    [
        ((7, 1), [False, True]),
        ((4, 4), [False, False]),  # equal classes, e.g. pipeline stages: nobody stands out
        ((9, 7), [False, False]),  # a near split is no evidence
        ((10, 5, 1), [False, True, True]),
        ((1, 1), [False, False]),
        ((12,), [False]),
    ],
)
def test_minority_classes_are_suspects(sizes, suspect):
    dumps, rank = [], 0
    world = sum(sizes)
    for k, size in enumerate(sizes):
        for _ in range(size):
            dumps.append(rank_dump(rank, world, thread(common(py(f"place{k}", 10 + k)))))
            rank += 1
    vc = equivalence_classes(build_tree(dumps, View.PY, world))
    assert [c.size for c in vc.classes] == list(sizes)
    assert [c.suspect for c in vc.classes] == suspect


def test_classes_say_where_they_part():
    tree = build_tree(odd_one_out(8, 5), View.PY, 8)
    first, second = equivalence_classes(tree).classes
    assert (first.size, first.ranks, second.ranks) == (7, "0-4/6-7", "5")
    d = second.divergence
    assert d is not None and d.reference == 1 and d.thread == "Thread@MainThread"
    assert d.after.startswith("train_step@")
    assert d.here.startswith("load_checkpoint@") and d.there.startswith("barrier@")
    assert second.tail == (d.here,)
    assert first.leaf.startswith("barrier@")
    assert second.score == pytest.approx(1 - 1 / 7, abs=1e-4)


def test_suspects_add_up_over_views_and_the_culprit_comes_first():
    world = 8
    dumps = odd_one_out(world, 5)
    # rank 2: same Python stack as the majority, but its native stack goes on elsewhere
    cuda = native("cudaStreamSynchronize", "/usr/local/cuda/lib64/libcudart.so.12")
    dumps[2] = rank_dump(2, world, thread(common(py("barrier", 4811, C10D), cuda)))
    # rank 3: the same wait, caught at another place inside the C library: timing, not evidence
    dumps[3] = rank_dump(3, world, thread(common(py("barrier", 4811, C10D), native("sched_yield"))))
    views = [equivalence_classes(build_tree(dumps, v, world)) for v in View]
    ranked = suspects(views, culprits=[7])
    assert [s.rank for s in ranked] == [7, 5, 2]
    assert ranked[0].score == 1.0 and ranked[0].reasons == ("named culprit by the verdict",)
    assert ranked[1].score > ranked[2].score
    assert len(ranked[1].reasons) == 2 and len(ranked[2].reasons) == 1


def test_a_wait_caught_at_another_place_in_the_c_library_is_one_class():
    """The innermost frames of a waiting thread inside libc (and unresolved ones) vary with
    timing; the native classes compare stacks above them, and the picture keeps them."""
    world = 6
    leaves = [
        [native("__futex_abstimed_wait_common"), native("futex_wait")],
        [native("sched_yield")],
        [native("0x7f3a00001234", "/usr/lib/libcuda.so.1"), native("poll")],
    ]
    cuda = native("cudaStreamSynchronize", "/usr/local/cuda/lib64/libcudart.so.12")
    dumps = [
        rank_dump(r, world, thread(common(py("barrier", 4811, C10D), cuda, *leaves[r % 3])))
        for r in range(world)
    ]
    tree = build_tree(dumps, View.CPP, world)
    (only,) = equivalence_classes(tree).classes
    assert only.size == world and only.leaf.startswith("cudaStreamSynchronize@")
    texts = {i.text for i in tree.info}
    assert {"sched_yield@/usr/lib/x86_64-linux-gnu/libc.so.6", "??@/usr/lib/libcuda.so.1"} <= texts


def big_tree(world: int, odd: int):
    rng = random.Random(3)
    dumps = []
    for r in range(world):
        if r == odd:
            inner = [py("load_checkpoint", 12), py("read_shard", 30)]
        else:
            # half the ranks each in a place of its own: 0.07 px wide each, merged into "other"
            leaf = f"spin{r}" if r % 2 else rng.choice(["sleep", "poll"])
            inner = [py("barrier", 4811, C10D), py(leaf, 5)]
        dumps.append(rank_dump(r, world, thread(common(*inner))))
    return build_tree(dumps, View.PY, world)


def test_layout_keeps_an_odd_rank_visible_at_scale_and_merges_thin_frames():
    world, odd = 16384, 9000
    tree = big_tree(world, odd)
    opts = LayoutSettings(width=1180, min_width=0.1, suspect_min_width=4)
    cells = layout(tree, suspects=1 << odd, opts=opts)
    odd_cells = [c for c in cells if c.node != OTHER and c.bits == 1 << odd]
    assert [tree.info[c.node].text.split("@")[0] for c in odd_cells] == [
        "load_checkpoint",
        "read_shard",
        "State",
    ]
    assert all(c.suspect and c.w >= 4 for c in odd_cells)
    others = [c for c in cells if c.node == OTHER]
    assert others and all(c.merged > 1 and c.w >= 0.1 for c in others)
    assert sum(c.count for c in others) > 0
    # children fit in their parent
    spans = {c.node: (c.x, c.x + c.w) for c in cells if c.node != OTHER}
    for c in cells:
        if c.node > 0 and c.node != OTHER:
            lo, hi = spans[tree.parent[c.node]]
            assert lo - 1e-6 <= c.x and c.x + c.w <= hi + 1e-6
    assert len(cells) < 3000


def test_layout_without_suspects_is_proportional():
    tree = build_tree(odd_one_out(8, 5), View.PY, 8)
    cells = layout(tree, suspects=0, opts=LayoutSettings(width=800))
    for c in cells:
        assert c.w == pytest.approx(c.count * 800 / tree.count[0])
        assert not c.suspect


def test_svg_marks_suspect_frames_and_is_well_formed():
    tree = build_tree(odd_one_out(8, 5), View.CPP, 8)
    svg = render_svg(tree, 1 << 5, FlameHeader("t", ("line",), ("suspects: 5",)))
    root = ET.fromstring(svg)
    cells = root.findall(f".//{SVG}g[@class]")
    marked = [g for g in cells if re.search(r"\bs\b", g.get("class", ""))]
    titles = [g.find(f"{SVG}title").text.split("\n")[0] for g in marked]
    assert [t.split("@")[0] for t in titles] == ["load_checkpoint", "read", "State"]
    tips = [g.find(f"{SVG}title").text for g in marked]
    assert all("1 rank of 8: 5" in t and "without: 0-4/6-7" in t for t in tips)
    fills = {g.find(f"{SVG}rect").get("fill") for g in marked}
    assert all(int(re.match(r"rgb\((\d+)", f).group(1)) >= 215 for f in fills)  # red family
    kinds = {c for g in cells for c in g.get("class").split() if c.startswith("k-")}
    assert kinds >= {"k-root", "k-state", "k-thread", "k-py", "k-torch", "k-native"}
    assert "<script" in svg and "http://" not in svg.replace("http://www.w3.org/2000/svg", "")
