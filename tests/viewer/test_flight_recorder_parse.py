"""The flight recorder dumps of an incident as `diag merge` reads them: real dumps captured from
torch (a 2-rank gloo job deadlocked across two groups, tests/support/evidence/flight_recorder_data), corrupt and
oversized files reported for their rank, symlinks not followed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from repo import SUPPORT

from diag.formats.untrusted import UntrustedInput
from diag.viewer import frdumps as flightrec
from diag.viewer import frsummary

DATA = SUPPORT / "evidence" / "flight_recorder_data"


def _incident(tmp_path: Path) -> Path:
    inc = tmp_path / "incident"
    shutil.copytree(DATA, inc / flightrec.FR_DIR)
    return inc


def test_real_dumps_give_each_ranks_last_collectives_and_who_is_behind(tmp_path: Path) -> None:
    rep = flightrec.read_incident([_incident(tmp_path)], 2)
    assert not rep.errors
    assert [(r.rank, r.backend) for r in rep.records] == [(0, "cpu"), (1, "cpu")]
    last0, last1 = rep.records[0].entries[-1], rep.records[1].entries[-1]
    # rank 0 waits in #4 of group 0, rank 1 in #4 of group 1; what both finished is completed
    assert (last0.op, last0.seq, last0.group, last0.state) == (
        "gloo:all_reduce",
        4,
        "0",
        "scheduled",
    )
    assert (last1.seq, last1.group, last1.state) == (4, "1", "scheduled")
    assert rep.records[0].entries[-2].state == "completed"
    lags = {lag.group: lag.behind for lag in rep.lags}
    assert lags == {"0": ((1, 3),), "1": ((0, 3),)}
    text = "\n".join(frsummary.to_lines(rep))
    assert "behind on group 0 (default_pg) [cpu]: rank 1 at #3; others enqueued #4" in text
    doc = frsummary.to_json(rep)
    assert doc["behind"][0]["ranks"] == [{"rank": 1, "last_enqueued": 3}]


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"entries": {}}', "entries must be a list"),
        (b'{"entries": [{"process_group": "0"}]}', "process_group"),
        (b'{"entries": [{"process_group": ["0", "x"], "state": "exploded"}]}', "state"),
        (b'{"entries": [{"process_group": ["0", "x"], "state": "started", '
         b'"collective_seq_id": -7}]}', "out of range"),
    ],
)  # fmt: skip
def test_a_corrupt_dump_is_reported_for_its_rank(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    inc = _incident(tmp_path)
    (inc / flightrec.FR_DIR / "00001-00002.json").write_bytes(content)
    rep = flightrec.read_incident([inc], 2)
    assert [r.rank for r in rep.records] == [0]
    assert len(rep.errors) == 1 and rep.errors[0][0] == 1, rep.errors
    assert problem in rep.errors[0][1] and "00001-00002.json" in rep.errors[0][1]
    assert any("rank 1:" in line for line in frsummary.to_lines(rep))


def test_an_oversized_dump_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    inc = _incident(tmp_path)
    monkeypatch.setattr(flightrec, "MAX_FILE_BYTES", 1000)
    rep = flightrec.read_incident([inc], 2)
    assert not rep.records and {r for r, _ in rep.errors} == {0, 1}
    assert "limit" in rep.errors[0][1]
    with pytest.raises(UntrustedInput, match="limit"):
        flightrec.parse_dump(b" " * 1001, "x", rank=0, world_size=1, backend="cpu")


def test_symlinks_and_names_out_of_range_are_not_read(tmp_path: Path) -> None:
    inc = _incident(tmp_path)
    fr = inc / flightrec.FR_DIR
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"entries": []}))
    (fr / "00001-00002.json").unlink()
    os.symlink(secret, fr / "00001-00002.json")
    shutil.copy(DATA / "00000-00002.json", fr / "00007-00008.json")  # rank beyond the world
    rep = flightrec.read_incident([inc], 2)
    assert [r.rank for r in rep.records] == [0]
    assert rep.errors[0][0] == 1 and "symlink" in rep.errors[0][1]
    # a symlinked flight-recorder directory is refused as a whole
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(fr, other / flightrec.FR_DIR)
    rep = flightrec.read_incident([other], 2)
    assert not rep.records and rep.errors and "symlink" in rep.errors[0][1]


def test_the_agents_note_of_a_rank_without_dump_is_shown(tmp_path: Path) -> None:
    inc = _incident(tmp_path)
    (inc / flightrec.FR_DIR / "00001-00002.json").unlink()
    (inc / flightrec.FR_DIR / "errors.json").write_text(
        json.dumps({"1": ["no answer from x.fr.sock in time"], "99": ["ignored"]})
    )
    rep = flightrec.read_incident([inc], 2)
    assert rep.errors == ((1, "no flight recorder: no answer from x.fr.sock in time"),)


def test_an_incident_without_flight_recorder_says_nothing(tmp_path: Path) -> None:
    rep = flightrec.read_incident([tmp_path], 2)
    assert rep.empty and frsummary.to_lines(rep) == []
