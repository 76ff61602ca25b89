"""The merge summary names each fact once, with one number: a real incident of the demo's hang
(tests/support/evidence/demo_hang_incident: rank 1 of 4 hung before an all-reduce; the agent's stacks,
journal tails, flight recorder dumps and verdict as it wrote them, with the install paths in
frames and command lines rewritten to /usr/local). The verdict counts group 1's collectives from
when diag attached, torch's flight recorder from the group's creation (4 broadcasts earlier):
the summary shows the journal's numbers in both places, and says the gap once."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from repo import SUPPORT

from diag.viewer import frdumps, frsummary
from diag.viewer.merge import merge_incident

INCIDENT = SUPPORT / "evidence" / "demo_hang_incident"


def _merged(tmp_path: Path) -> tuple[str, dict]:
    inc = tmp_path / "incident"
    shutil.copytree(INCIDENT, inc)
    merged = merge_incident(inc)
    return merged.summary_txt.read_text(), json.loads(merged.summary_json.read_text())


def test_one_fact_one_number_in_the_summary(tmp_path: Path) -> None:
    text, doc = _merged(tmp_path)
    verdict = doc["verdict_summaries"][0]
    assert "wait in all_reduce #19 of group 1" in verdict and "was #18" in verdict, verdict
    # the flight recorder, in the verdict's numbers and names
    assert "behind on group 1 [cpu]: rank 1 at #18; others enqueued #19" in text, text
    assert "gloo:all_reduce #19 scheduled, group 1" in text, text
    assert "torch's numbers on group 1 [cpu] are 4 higher" in text, text
    assert "undefined" not in text and "undefined" not in json.dumps(doc)
    assert not re.search(r"#2[0-3]\b", text), text  # torch's own numbers stay out of the text
    fr = doc["flight_recorder"]
    assert fr["numbering"] == [{"backend": "cpu", "group": "1", "torch_offset": 4}]
    assert fr["behind"][0]["ahead"] == 19
    assert fr["behind"][0]["ranks"] == [{"rank": 1, "last_enqueued": 18}]
    # a rank's suspicion: one score, in SUSPECTS; the classes say SUSPECT without a second one
    assert re.findall(r"score \d\.\d\d", text) == ["score 1.00"], text
    assert "class 2: 1 rank 1   SUSPECT\n" in text, text
    assert [s["score"] for s in doc["suspects"]] == [1.0]
    for view in doc["views"].values():
        assert all("score" not in c for c in view["classes"]), view["classes"]
        assert [c["minority_score"] for c in view["classes"]] == [0.0, 0.6667]


def test_torchs_numbers_stay_when_the_journal_does_not_match(tmp_path: Path) -> None:
    """A journal tail whose last op is not the op at the recorder's number (a rank dumped
    between its journal write and torch's enqueue, or a group both backends share) gives no
    gap: the summary keeps torch's numbers rather than guess."""
    inc = tmp_path / "incident"
    shutil.copytree(INCIDENT, inc)
    rep = frdumps.read_incident([inc], 4)
    good = {r.rank: {"1": (19, "all_reduce")} for r in rep.records if r.rank != 1}
    good[1] = {"1": (18, "all_gather_base")}
    assert frsummary.numbering(rep, good).offsets == (("cpu", "1", 4),)
    off_by_one = {**good, 1: {"1": (17, "all_reduce")}}  # 17+5 = 22 is the all_gather
    assert frsummary.numbering(rep, off_by_one).offsets == ()
    assert frsummary.numbering(rep, {}).offsets == ()
    lines = "\n".join(frsummary.to_lines(rep, frsummary.numbering(rep, off_by_one)))
    assert "rank 1 at #22; others enqueued #23" in lines and "higher" not in lines, lines
