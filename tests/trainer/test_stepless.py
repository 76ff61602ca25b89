"""End to end: a job that never marks a step (`diag.trainer.attach()` without an engine, no
`diag.trainer.step()`) loops all-reduces on 3 gloo ranks; after 45 s rank 1 stops issuing them.
A real `diag agent` with its default limits (warm-up 900 s, floor 10 s, 30 s of steady pace) must
have left warm-up on the pace of the ops, said so once, and find the hang on the adaptive limit,
in seconds."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from wait_launch import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_job_without_steps_is_judged_on_the_pace_of_its_ops(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "stepless",
        nproc=3,
        job_args=("--fault-rank", "1", "--fault-after", "45", "--step-seconds", "0.1"),
        timeout=180,
    )
    v = result.verdict
    log = result.agent_log()
    assert v["kind"] == "hang" and v["culprit"] == 1, v["summary"]
    assert v["suspects"][0]["kind"] == "behind"
    for o in v["overdue"]:
        assert o["rank"] in (0, 2) and o["limit_s"] == 10.0, o  # the floor, not 900 s
        assert "no step marked, ops at a steady pace" in o["limit_basis"]
    detected = dt.datetime.fromisoformat(v["detected_at"]).timestamp()
    assert 9.0 <= detected - result.fault_wall() < 15.0, (detected, result.fault_wall())
    warnings = [line for line in log.splitlines() if "no-steps:" in line]
    assert len(warnings) == 1, log[-3000:]
    assert "WARNING" in warnings[0] and "ranks 0,1,2 mark no training steps" in warnings[0]
    assert "900 s warm-up limit no longer applies" in warnings[0]
