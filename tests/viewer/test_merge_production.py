"""`diag merge` on production-shaped incidents (bench/incident_gen.py): ~15 Python and ~60
native threads per rank, helper threads that differ by timing and by thread counters, odd ranks,
ranks and whole nodes without a dump, corrupt and timed-out dumps, in the three formats."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from incidentkit import gen

from diag.viewer import ranksets
from diag.viewer.merge import merge_incident
from diag.viewer.sources import DumpFormat


def merged(tmp_path: Path, world: int, fmt: str, scenario: str, local: int | None, **kw):
    truth = gen.write_incident(
        tmp_path / "inc", gen.plan_incident(world, fmt=fmt, scenario=scenario, **kw), workers=2
    )
    return truth, merge_incident(tmp_path / "inc", out_dir=tmp_path / "out", local_world_size=local)


def check(truth, result) -> None:
    found = [s.rank for s in result.suspects]
    odd = list(truth.odd_ranks)
    silent = list(truth.unanswered)
    if odd:
        # the odd ranks lead; the ranks that did not answer follow
        assert sorted(found[: len(odd)]) == odd
        assert sorted(found[len(odd) :]) == silent
    else:
        assert sorted(found) == silent
        assert all(s.score == 1.0 for s in result.suspects)
    # helper differences (counters, one more queue feeder, a busy logger) make no suspect
    assert len(found) < 0.02 * truth.world_size
    nodes = [n.bits for n in result.absent.nodes]
    assert nodes == [ranksets.bits_of(truth.node_ranks(n)) for n in truth.missing_nodes]
    summary = result.summary_txt.read_text()
    for n in truth.missing_nodes:
        assert f"node {n} (ranks {ranksets.fold(ranksets.bits_of(truth.node_ranks(n)))})" in summary
    assert truth.renumbered_ranks > 0 and truth.extra_feeder_ranks


@pytest.mark.parametrize(
    ("fmt", "scenario", "local"),
    [
        ("xpu", "odd", 8),
        pytest.param("diag", "agree", None, marks=pytest.mark.slow),
        pytest.param("pyspy", "odd", 8, marks=pytest.mark.slow),
        pytest.param("xpu", "agree", 8, marks=pytest.mark.slow),
    ],
)
def test_1344_ranks(tmp_path: Path, fmt: str, scenario: str, local: int | None) -> None:
    truth, result = merged(tmp_path, 1344, fmt, scenario, local, odd=2)
    check(truth, result)
    if fmt == "diag":
        assert result.absent.local_world_size == 8  # from the dumps' local ranks


def test_mixed_formats_small(tmp_path: Path) -> None:
    truth, result = merged(tmp_path, 96, "mixed", "agree", 8)
    # ranks take the formats in turn; the ranks without a file take none
    expect = Counter(
        ("diag", "xpu", "pyspy")[r % 3] for r in range(96) if r not in truth.missing_ranks
    )
    assert len(expect) == 3 and sum(expect.values()) == 96 - len(truth.missing_ranks)
    assert truth.formats == dict(expect)
    suffixes = {".stack.json": "diag", ".stacktrace": "xpu", ".pyspy.json": "pyspy"}
    on_disk = Counter(
        fmt
        for p in (tmp_path / "inc").iterdir()
        for s, fmt in suffixes.items()
        if p.name.endswith(s)
    )
    assert on_disk == expect
    # the merge read every file, corrupt and timed-out ones included, each in its format
    read = {DumpFormat.DIAG: "diag", DumpFormat.XPU_TIMER: "xpu", DumpFormat.PYSPY: "pyspy"}
    assert {read[DumpFormat(k)]: v for k, v in result.report.formats} == dict(expect)
    assert sorted(s.rank for s in result.suspects[: len(truth.unanswered)]) == list(
        truth.unanswered
    )


def test_silent_node_has_its_own_tower(tmp_path: Path) -> None:
    truth, result = merged(tmp_path, 64, "xpu", "agree", 8, missing_ranks=0, corrupt=0, timed_out=0)
    (node,) = truth.missing_nodes
    text = result.folded[next(iter(result.folded))].read_text()
    label = f"State@no dump: node {node} (ranks {ranksets.fold(ranksets.bits_of(truth.node_ranks(node)))}) did not answer"
    assert label in text


@pytest.mark.slow
@pytest.mark.timeout(1800)  # generation and merge of ~700 MB on a shared machine
# The long tier: the 1,344-rank incidents above, shaped the same way, run in the default tier;
# bench/merge_production.py measures merges at this scale.
@pytest.mark.long
@pytest.mark.parametrize("scenario", ["odd", "agree"])
def test_16384_ranks(tmp_path: Path, scenario: str) -> None:
    truth, result = merged(tmp_path, 16384, "pyspy", scenario, 8, odd=3, missing_nodes=2)
    check(truth, result)
