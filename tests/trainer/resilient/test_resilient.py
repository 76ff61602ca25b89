"""In-place recovery end to end (diag.trainer.resilient) with real 2-rank DeepSpeed jobs under
torchrun (gloo, CPU, flash checkpointer): a rank hung in Python (a long sleep, a busy loop, or
asleep after `resilient.interrupt`) is interrupted, every rank keeps its process, the world
re-forms under the next generation and training goes on from the step every rank holds in
memory. The losses after each recovery match an uninterrupted run of the same processes, at ZeRO
1, 2 and 3, and the recoveries leak no threads, file descriptors, sockets or shared memory; the
RSS growth is recorded."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jobrun
import pytest
from repo import SUPPORT
from resilientchecks import check_no_leaks, check_stage, lines, recover_at_the_agents_verdict

JOB = SUPPORT / "jobs" / "resilient_job.py"
TIMEOUT_S = "3"  # the collective timeout that notices the hung rank (no agent here)


@dataclass
class Run:
    root: Path
    run_dir: Path

    def launch(self, *args: str, timeout: float) -> int:
        cmd = jobrun.command(
            2, JOB, "--save-dir", str(self.root / "ckpt"), "--out", str(self.root / "out"),
            "--timeout", TIMEOUT_S, *args,
        )  # fmt: skip
        env = dict(os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(SUPPORT))  # fmt: skip
        return jobrun.run(cmd, self.root / "job.log", env, timeout)

    def stage(self, zero: int) -> Path:
        return self.root / "out" / f"z{zero}"

    def log(self) -> str:
        return (self.root / "job.log").read_text(errors="replace")[-6000:]


@pytest.fixture
def run() -> Iterator[Run]:
    root = Path(tempfile.mkdtemp(prefix="diag-test-resilient-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-resilient-run-", dir="/dev/shm"))
    try:
        yield Run(root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_a_rank_hung_in_python_recovers_in_place_at_every_zero_stage(run: Run) -> None:
    steps, hangs = 8, [2, 3, 5, 6]
    rc = run.launch(
        "--zero", "1,2,3", "--steps", str(steps), "--hang-steps", ",".join(map(str, hangs)),
        "--hang-modes", "spin,sleep,interrupt", timeout=420,
    )  # fmt: skip
    assert rc == 0, run.log()
    for zero in (1, 2, 3):
        attempts = check_stage(run.stage(zero), hangs, steps)
        if zero != 3:  # ZeRO 3's bounded retention needs more recoveries to tell: the long tier
            print(f"zero {zero}:", check_no_leaks(attempts))
    # ZeRO 3: `resilient.interrupt` on the hung rank (what the agent's verdict calls) reached both.
    # (Not in a stage whose leaks are checked: the survivor's wait it abandons stays in gloo, with
    # the old world's threads, until the collective's timeout ends it.)
    for rank in (0, 1):
        faults = " ".join(x["fault"] for x in lines(run.stage(3) / f"attempts-{rank}.jsonl"))
        assert "the agent's verdict (as the control channel delivers it)" in faults, faults
    # Both ends of a fault were seen: the rank whose collective timed out, the one interrupted.
    faults = " ".join(x["fault"] for x in lines(run.stage(2) / "attempts-1.jsonl"))
    assert "interrupted" in faults, faults
    faults = " ".join(x["fault"] for x in lines(run.stage(2) / "attempts-0.jsonl"))
    assert "timed_out" in faults, faults
    assert not list(run.run_dir.iterdir())  # the slots removed at the end


@pytest.mark.slow
def test_the_agents_hang_verdict_recovers_a_rank_in_place(run: Run) -> None:
    """`diag agent --on-hang recover` with the job attached: the ranks' collective timeout is
    120 s, so what ends the hang (rank 1 asleep, rank 0 blocked in an all-reduce) is the agent's
    verdict, sent over the control channel: the hung rank is interrupted, the blocked one's wait
    ends, and both train on from the step they hold in memory."""
    _, agent_log = recover_at_the_agents_verdict(run, 240)
    assert "stopping rank" not in agent_log
    (incident,) = (run.root / "timeline").glob("*-hang-*")
    assert json.loads((incident / "verdict.json").read_text())["culprit"] == 1


@pytest.mark.slow
@pytest.mark.long
def test_twenty_recoveries_in_one_process_leak_nothing(run: Run) -> None:
    hangs = list(range(2, 22))
    steps = hangs[-1] + 2
    rc = run.launch(
        "--zero", "2,3", "--steps", str(steps), "--hang-steps", ",".join(map(str, hangs)),
        "--hang-modes", "sleep,spin", timeout=1500,
    )  # fmt: skip
    assert rc == 0, run.log()
    for zero, base in ((2, 2), (3, 8)):  # ZeRO 3: past its bounded retention (check_no_leaks)
        attempts = check_stage(run.stage(zero), hangs, steps)
        print(f"zero {zero}, 20 recoveries:", check_no_leaks(attempts, base))
