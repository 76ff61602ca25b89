"""End to end: a real gloo job under torchrun whose rank 1 runs out of data a few steps before
the others (uneven shards) and exits 0, watched by a real `diag agent` process. The verdict must
name rank 1, say how it ended and where it was, and that the others went on, whether the peers
then fail (the connection closes) or hang (a forked worker holds the connection open)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from wait_launch import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

FAULT_STEP = 6
JOB = ("--fault-rank", "1", "--fault-step", str(FAULT_STEP), "--pg-timeout", "120")
AGENT = ("--hang-floor", "3", "--warmup-timeout", "60")
NAMED = re.compile(
    r"^rank 1 ended cleanly \(its journal closed at exit, no uncaught exception\) after step 5 "
    r"\(its last op: "
    r"all_reduce #(\d+) of group 0\) while ranks 0,2,3 went on to all_reduce #(\d+) of group 0: "
    r"its data may have run out before theirs"
)


def _named(v: dict) -> None:
    assert v["kind"] == "rank_exited", v["summary"]
    assert v["culprit"] == 1, v["summary"]
    assert v["suspects"][0]["kind"] == "left" and v["suspects"][0]["rank"] == 1, v["suspects"]
    m = NAMED.match(v["summary"])
    assert m, v["summary"]
    assert int(m.group(2)) == int(m.group(1)) + 1


def test_rank_exiting_0_early_is_named_when_its_peers_fail(tmp_path: Path) -> None:
    result = run(tmp_path, "leaver", job_args=JOB, agent_args=AGENT)
    _named(result.verdict)
    assert "failed with an uncaught exception" not in result.verdict["summary"]


def test_rank_exiting_0_early_is_named_when_its_peers_hang(tmp_path: Path) -> None:
    result = run(tmp_path, "leaver-hang", job_args=JOB, agent_args=AGENT)
    v = result.verdict
    _named(v)
    assert "ended after it" not in v["summary"]  # the peers were still waiting: nobody failed
