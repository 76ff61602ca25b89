"""torch's flight recorder in an incident, end to end on CPU: a real 2-rank gloo job deadlocked
across two groups, a real `diag agent` that asks each rank for its flight recorder while the
ranks are stuck, the per-rank dumps in the incident directory, and `diag merge` showing them
beside the stacks with the ranks behind on each group's sequence numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wait_launch import run

from diag.viewer.merge import merge_incident

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

AGENT = ("--hang-floor", "3", "--warmup-timeout", "60")
JOB = ("--fault-rank", "1", "--fault-step", "4", "--pg-timeout", "120")


def test_hang_takes_every_ranks_flight_recorder_and_merge_shows_who_is_behind(
    tmp_path: Path,
) -> None:
    result = run(tmp_path, "groups", nproc=2, job_args=JOB, agent_args=AGENT)
    v = result.verdict
    incident = next(d for d in (tmp_path / "timeline").iterdir() if (d / "verdict.json").is_file())
    fr = v["flight_recorder"]
    assert fr["dir"] == "flight-recorder", fr
    files = sorted(p.name for p in (incident / "flight-recorder").iterdir())
    assert files == ["00000-00002.json", "00001-00002.json"], (files, fr)
    dumps = {n: json.loads((incident / "flight-recorder" / n).read_text()) for n in files}
    # torch's own dump, as the rank's C++ server sent it: collectives of both groups
    for doc in dumps.values():
        assert {e["profiling_name"] for e in doc["entries"]} >= {"gloo:all_reduce"}
        assert len({e["process_group"][0] for e in doc["entries"]}) >= 2

    merged = merge_incident(incident)
    report = merged.report.flight
    assert report is not None and not report.errors, report
    assert [r.rank for r in report.records] == [0, 1]
    # each rank waits in the group the other has not reached: both are behind somewhere
    behind = {lag.group: [k for k, _ in lag.behind] for lag in report.lags}
    assert sorted(k for ks in behind.values() for k in ks) == [0, 1], behind
    text = merged.summary_txt.read_text()
    assert "FLIGHT RECORDER" in text and "gloo:all_reduce" in text, text
    assert "behind on group" in text and "undefined" not in text, text
    summary = json.loads(merged.summary_json.read_text())
    assert [r["rank"] for r in summary["flight_recorder"]["ranks"]] == [0, 1]
    states = {e["state"] for r in summary["flight_recorder"]["ranks"] for e in r["last"]}
    assert "scheduled" in states and "completed" in states, summary["flight_recorder"]
