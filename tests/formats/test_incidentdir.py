"""The incident directory, one type for both sides: what the agent builds with `IncidentDir.create`
the viewer reads back with the same names and the same verdict parsing."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

from diag.formats.incidentdir import (
    MACHINE_FILE,
    VERDICT_FILE,
    IncidentDir,
    Verdict,
    dir_name,
    find_dirs,
    incident_id_of,
    incident_key,
    journal_tail_file,
    name_time,
    read_verdict,
    tail_name,
)
from diag.formats.stackdump import dump_file_name
from diag.viewer.incidents import find_incidents

WHEN = dt.datetime(2026, 3, 4, 5, 6, 7, tzinfo=dt.UTC)


def test_a_directory_the_agent_builds_is_found_and_read_by_the_viewer(tmp_path: Path) -> None:
    incident_id = incident_id_of("train", "hang-ag3")
    built = IncidentDir.create(tmp_path, "hang", "node-1", WHEN, incident_id)
    assert built.tmp is not None and built.tmp.name.startswith(".tmp-")
    assert built.path == tmp_path / dir_name(WHEN, "hang", "node-1", incident_id)
    built.write_json(journal_tail_file(1, 2), {"records": []})
    built.write_json(MACHINE_FILE, {"node": "node-1"})
    verdict = {"incident_id": incident_id, "kind": "hang", "node": "node-1", "world_size": 2}
    built.write_json(VERDICT_FILE, {**verdict, "culprit": 1, "detected_at": WHEN.isoformat()})
    assert not built.path.exists()  # nothing visible before the commit
    path = built.commit()
    assert path == built.path and path.is_dir() and not built.tmp.exists()

    assert find_dirs(tmp_path, incident_key(incident_id)) == [path]
    assert name_time(path.name) == WHEN
    (incident,) = find_incidents(tmp_path)
    (read,) = incident.dirs
    assert isinstance(read, IncidentDir)
    assert read.path == path and read.tmp is None and read.problems == ()
    assert read.verdict == Verdict(incident_id, "hang", "node-1", "", 2, WHEN.isoformat(), 1, "")
    assert incident.when == WHEN and incident.culprits == [1]


def test_the_journal_tail_sits_beside_its_dump_under_one_name() -> None:
    assert tail_name(dump_file_name(3, 8)) == journal_tail_file(3, 8) == "00003-00008.journal.json"


def test_an_unreadable_verdict_is_a_problem_not_an_error(tmp_path: Path) -> None:
    assert read_verdict(tmp_path) == (None, ())
    (tmp_path / VERDICT_FILE).write_text(json.dumps({"kind": "hang"}))
    verdict, problems = read_verdict(tmp_path)
    assert verdict is None
    assert len(problems) == 1 and "unreadable verdict (no incident_id)" in problems[0]


def test_a_finished_directory_is_not_written_to(tmp_path: Path) -> None:
    built = IncidentDir.create(tmp_path, "crash", "n", WHEN)
    built.commit()
    read = IncidentDir(path=built.path)
    with pytest.raises(ValueError, match="a finished incident directory is not written to"):
        read.write_text("x.txt", "x")
    assert os.listdir(built.path) == []


def test_a_second_directory_of_the_same_second_gets_its_own_name(tmp_path: Path) -> None:
    first = IncidentDir.create(tmp_path, "hang", "n", WHEN, "job-x").commit()
    second = IncidentDir.create(tmp_path, "hang", "n", WHEN, "job-x")
    assert second.path.name == f"{first.name}.2"
    second.abandon()
    assert sorted(os.listdir(tmp_path)) == [first.name]
    assert find_dirs(tmp_path, incident_key("job-x")) == [first]
