"""Ranks that did not answer: which, why, and the nodes they fill (pure, table-driven)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mergekit import C10D, common, native, odd_one_out, py, rank_dump, thread, write_incident

from diag.formats.stackdump import RankDump
from diag.viewer import ranksets
from diag.viewer.absent import find_absent, local_world_size, stand_ins
from diag.viewer.classes import SILENT_SCORE, suspects
from diag.viewer.merge import merge_incident


def answered(ranks, world=16, **kw):
    return [
        RankDump(rank=r, world_size=world, pid=1, threads=(thread([py("f")]),), **kw) for r in ranks
    ]


@pytest.mark.parametrize(
    ("present", "local", "nodes"),
    [
        (set(range(16)) - set(range(8, 16)), 8, [1]),  # the second node is gone
        (set(range(16)) - {8, 9, 10}, 8, []),  # a few ranks only: no node
        (set(range(16)) - set(range(4, 8)), 4, [1]),
        (set(range(16)) - set(range(4, 8)), None, []),  # no local world size: no node named
        (set(range(16)) - set(range(4, 12)), 4, [1, 2]),
    ],
)
def test_silent_nodes(present, local, nodes) -> None:
    a = find_absent(16, answered(sorted(present)), local)
    assert a.missing == ranksets.bits_of(set(range(16)) - present)
    assert [n.index for n in a.nodes] == nodes


def test_unreadable_and_timed_out_dumps_count_as_silent_and_fill_nodes() -> None:
    dumps = [
        *answered(range(4)),
        RankDump(rank=4, world_size=8, pid=0, error="unreadable diag.stack/1 file: bad JSON"),
        RankDump(rank=5, world_size=8, pid=0, error="py-spy dump timed out after 30 s"),
    ]
    a = find_absent(8, dumps, 4)
    assert ranksets.ranks_of(a.bits) == [4, 5, 6, 7]
    assert [n.label for n in a.nodes] == ["node 1 (ranks 4-7)"]
    assert (
        a.reason(5)
        == "did not answer: py-spy dump timed out after 30 s; all of node 1 (ranks 4-7) is silent"
    )
    assert a.reason(6) == "did not answer: no dump; all of node 1 (ranks 4-7) is silent"
    # stand-ins are drawn for ranks without a file only
    assert [d.rank for d in stand_ins(a, 8)] == [6, 7]
    # the ranks that answered agree: the silent ones lead with score 1
    assert [(s.rank, s.score) for s in suspects([], (), a)] == [
        (r, SILENT_SCORE[True]) for r in (4, 5, 6, 7)
    ]


def test_local_world_size_from_flag_journals_then_dumps() -> None:
    dumps = [
        RankDump(rank=r, world_size=16, pid=1, node=f"n{r // 4}", local_rank=r % 4)
        for r in range(16)
    ]
    assert local_world_size(dumps, [], 8) == 8
    assert local_world_size(dumps, [2, 2]) == 2
    assert local_world_size(dumps, []) == 4
    assert local_world_size(answered(range(4)), []) is None  # files without node information


def test_local_world_size_from_journal_tails(tmp_path: Path) -> None:
    d = write_incident(tmp_path / "inc", odd_one_out(16, 3)[:8])
    (d / "00000-00016.journal.json").write_text(json.dumps({"meta": {"local_world_size": 8}}))
    result = merge_incident(d, out_dir=tmp_path / "out")
    assert [n.label for n in result.absent.nodes] == ["node 1 (ranks 8-15)"]
    assert "whole nodes: node 1 (ranks 8-15)" in result.summary_txt.read_text()
    summary = json.loads(result.summary_json.read_text())
    assert summary["silent_nodes"] == [{"node": 1, "ranks": "8-15"}]


def test_the_verdicts_culprit_leads_among_equal_scores() -> None:
    a = find_absent(8, answered(range(1, 8), world=8), None)
    assert [s.rank for s in suspects([], (5,), a)] == [5, 0]


def test_a_rank_whose_native_stacks_were_not_taken_is_no_native_suspect(tmp_path: Path) -> None:
    # every rank waits in the same native wait but rank 3, whose dump skipped the native pass
    # (memory or time): no native evidence for it, so no native class either; rank 2 is odd
    world = 5
    waiting = [py("barrier", 4811, C10D), native("std::condition_variable::wait")]
    stuck = [py("load_checkpoint", 14), native("time_sleep")]
    dumps = [
        rank_dump(r, world, thread(common(*(stuck if r == 2 else waiting)))) for r in range(world)
    ]
    dumps[3] = rank_dump(3, world, thread(common(py("barrier", 4811, C10D))))  # Python only
    result = merge_incident(write_incident(tmp_path / "inc", dumps), out_dir=tmp_path / "out")
    assert [s.rank for s in result.suspects] == [2], result.suspects
    cpp = next(v for v in result.report.views if v.view.value == "cpp")
    assert all(3 not in ranksets.ranks_of(c.bits) for c in cpp.classes)
