"""Readable pictures of production-shaped incidents (bench/incident_gen.py: ~15 Python and ~60
native threads per rank, native stacks up to ~200 frames with unresolved ones): shared runs of
frames fold into one cell, unresolved runs collapse, helper threads keep to their band, and in
headless Chromium the odd rank and the silent node are visible, the picture is less than two
screens tall, search by rank finds the odd rank and a folded cell opens."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from incidentkit import gen
from test_merge_browser import dom

from diag.formats.stackdump import FrameInterner, RankDump, pyspy_threads
from diag.viewer import ranksets
from diag.viewer.analysis import About, analyse, draw
from diag.viewer.flamelayout import LayoutSettings, is_helper, layout
from diag.viewer.gather import gather_dumps
from diag.viewer.labels import FrameKind
from diag.viewer.merge import merge_incident
from diag.viewer.tree import View, build_tree

SCREEN = 1080  # px: a laptop screen, roughly


def dumps_of(truth) -> list[RankDump]:
    interner = FrameInterner()
    out = []
    for r in range(truth.world_size):
        plan = gen.rank_plan(truth, r)
        rt = gen.rank_threads(plan, random.Random(plan.seed))
        raw = gen.diag_dump(rt, r, truth.world_size, truth.local_world_size, "S (sleeping)")
        out.append(RankDump.from_dict(raw, interner))
    return out


@pytest.fixture(scope="module")
def small():
    truth = gen.plan_incident(
        64, scenario="odd", odd=1, missing_nodes=0, missing_ranks=0, corrupt=0, timed_out=0
    )
    return truth, dumps_of(truth)


def test_native_view_folds_to_a_few_rows(small):
    truth, dumps = small
    deepest = max(len(t.frames) for d in dumps for t in d.native_threads)
    assert deepest >= 150 and min(len(d.native_threads) for d in dumps) >= 50
    tree = build_tree(dumps, View.CPP, truth.world_size)
    assert max(tree.depth) >= 150  # the tree itself keeps every frame
    cells = layout(tree, ranksets.bits_of(truth.odd_ranks))
    rows = max(c.depth for c in cells)
    assert rows < 40, rows
    folded = [c for c in cells if c.folded]
    assert folded and max(len(c.folded) for c in folded) >= 50
    # a folded cell stands for a run its ranks all share, and sits right below its innermost
    for c in folded:
        assert all(
            tree.children[a] == [b] for a, b in zip(c.folded[:-1], c.folded[1:], strict=True)
        )
        assert tree.parent[c.node] == c.folded[-2] if len(c.folded) > 1 else True
    # runs of unresolved frames are one frame each: no `??` under another `??` of its library
    texts = [i.text for i in tree.info]
    assert any(re.match(r"\?\? x\d+@", t) for t in texts)
    for n in range(1, len(tree)):
        p = tree.parent[n]
        if tree.info[n].text.startswith("??@"):
            assert tree.info[p].text != tree.info[n].text


def test_helper_threads_keep_to_their_band(small):
    truth, dumps = small
    for view in View:
        tree = build_tree(dumps, view, truth.world_size)
        cells = layout(tree, 0, LayoutSettings(width=1000.0))
        helpers = sum(c.w for c in cells if c.depth == 1 and is_helper(tree, c.node))
        training = sum(c.w for c in cells if c.depth == 1 and not is_helper(tree, c.node))
        assert helpers <= 200.0 + 1e-6 and training >= 800.0 - 1e-6, (view, helpers, training)


def svg_height(svg: Path) -> int:
    return int(re.search(r'<svg[^>]* height="(\d+)"', svg.read_text()[:2000]).group(1))


def cells_of(page: str) -> list[tuple[str, str, float]]:
    """(class, title, width) of every frame cell in a dumped DOM."""
    out = []
    for seg in page.split('<g class="f ')[1:]:
        cls = seg.split('"', 1)[0]
        title = seg.split("<title>", 1)[1].split("</title>", 1)[0]
        w = float(re.search(r'<rect[^>]* width="([\d.]+)"', seg).group(1))
        out.append((cls, title, w))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_production_incident_in_chromium(tmp_path: Path):
    truth = gen.write_incident(
        tmp_path / "inc", gen.plan_incident(1344, fmt="xpu", scenario="odd", odd=2), workers=2
    )
    result = merge_incident(tmp_path / "inc", out_dir=tmp_path / "out", local_world_size=8)
    (node,) = truth.missing_nodes
    for view, svg in result.svgs.items():
        assert svg_height(svg) < 2 * SCREEN, (view, svg_height(svg))
        page = dom(tmp_path, svg.as_uri())
        assert 'data-ready="1"' in page
        cells = cells_of(page)
        # the silent node is a tower of its own, wide enough to see and to point at
        tower = [w for _, t, w in cells if t.startswith(f"State@no dump: node {node} ")]
        assert tower and tower[0] >= 40, tower
        # each odd rank: red frames of a usable width, found by a search for its rank
        for odd in truth.odd_ranks:
            found = dom(tmp_path, f"{svg.as_uri()}?s=rank:{odd}")
            matched = [(c, w) for c, _, w in cells_of(found) if " match" in c]
            assert any(" s" in c and w >= 7.9 for c, w in matched), (view, odd, matched[:5])
            assert f"rank {odd}: " in found
    # a folded native cell opens in place into its frames, on the page
    text = result.cpp_svg.read_text()
    assert 'data-fold="' in text
    opened = dom(tmp_path, f"{result.cpp_svg.as_uri()}?x=PyEval_EvalFrameDefault")
    assert " unfolded" in opened and opened.count(" unfolded") > 20
    assert svg_height(result.cpp_svg) < int(re.search(r'<svg[^>]* height="(\d+)"', opened).group(1))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_16384_ranks_in_chromium(tmp_path: Path):
    """16,384 production-shaped ranks and a node that did not answer, drawn as `diag merge`
    draws them: the stacks are built in memory (64 ranks' stacks stand for the others, with the
    odd ranks' own: writing 4 GB of dumps is the merge bench's business), then gathered,
    analysed and drawn by the merge's own code (gather_dumps, analyse, draw)."""
    world = 16384
    truth = gen.plan_incident(
        world, scenario="odd", odd=2, missing_nodes=1, missing_ranks=0, corrupt=0, timed_out=0
    )
    base = dumps_of(
        gen.plan_incident(
            64, scenario="agree", missing_nodes=0, missing_ranks=0, corrupt=0, timed_out=0
        )
    )
    interner = FrameInterner()
    odd = {}
    for r in truth.odd_ranks:
        plan = gen.rank_plan(truth, r)
        rt = gen.rank_threads(plan, random.Random(plan.seed))
        raw = gen.diag_dump(rt, r, world, 8, "S (sleeping)")
        odd[r] = RankDump.from_dict(raw, interner)
    silent = set(truth.missing_ranks)
    dumps = [
        odd.get(r) or replace(base[r % 64], rank=r, world_size=world)
        for r in range(world)
        if r not in silent
    ]
    merged = analyse(gather_dumps(dumps), world, (), truth.local_world_size)
    (node,) = merged.absent.nodes
    assert node.index == truth.missing_nodes[0] and node.bits == ranksets.bits_of(silent)
    found = [s.rank for s in merged.suspects]
    assert sorted(found[:2]) == list(truth.odd_ranks) and sorted(found[2:]) == sorted(silent)
    about = About("20261123-041209-hang-16k", "hang", ("node-0000",))
    first_silent = min(silent)
    for view in View:
        svg = tmp_path / f"{view.value}_stack.svg"
        svg.write_text(draw(view, about, merged))
        assert svg_height(svg) < 2 * SCREEN, (view, svg_height(svg))
        page = dom(tmp_path, svg.as_uri())
        assert 'data-ready="1"' in page
        # the silent node: a tower of its own, wide enough to see without zooming
        label = f"State@no dump: {node.label} did not answer"
        tower = [w for _, t, w in cells_of(page) if t.startswith(label)]
        assert tower and tower[0] >= 40, (view, tower)
        # search by rank: each odd rank's red frames, and the silent node's tower
        for r in truth.odd_ranks:
            found = dom(tmp_path, f"{svg.as_uri()}?s=rank:{r}")
            matched = [(c, w) for c, _, w in cells_of(found) if " match" in c]
            assert any(" s" in c and w >= 7.9 for c, w in matched), (view, r, matched[:5])
            assert f"rank {r}: " in found
        found = dom(tmp_path, f"{svg.as_uri()}?s=rank:{first_silent}")
        matched = [t for c, t, _ in cells_of(found) if " match" in c]
        assert any(t.startswith(label) for t in matched), (view, matched[:5])


def test_interleaved_python_frames_stay_with_their_thread():
    """py-spy --native interleaves Python and native frames per thread: in the native view each
    thread's Python frames sit in that thread's tower, never in the training thread's."""
    truth = gen.plan_incident(
        16, scenario="agree", missing_nodes=0, missing_ranks=0, corrupt=0, timed_out=0
    )
    dumps = []
    for r in range(truth.world_size):
        plan = gen.rank_plan(truth, r)
        rng = random.Random(plan.seed)
        rt = gen.rank_threads(plan, rng)
        raw = gen.pyspy_dump(rt, gen.Addresses(rng))
        dumps.append(
            RankDump(rank=r, world_size=16, pid=rt.pid, native=True, threads=pyspy_threads(raw))
        )
    tree = build_tree(dumps, View.CPP, 16)
    seen = set()
    for n in range(1, len(tree)):
        info = tree.info[n]
        if info.native or info.kind not in (FrameKind.PYTHON, FrameKind.TORCH):
            continue
        thread = tree.info[tree.thread_of(n)].text
        role = tree.info[tree.parent[tree.thread_of(n)]].text
        if "/torch/utils/data/_utils/pin_memory.py" in info.text:
            assert role == "Role@data loader", (thread, info.text)
            seen.add("pin memory")
        if "/logging/handlers.py" in info.text:
            assert role == "Role@logging", (thread, info.text)
            seen.add("logging")
        if "_inner_training_loop@" in info.text:
            assert role == "Role@training", (thread, info.text)
            seen.add("training")
    assert seen == {"pin memory", "logging", "training"}, seen
