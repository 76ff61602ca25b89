"""A hang soon after a launch, and one soon after a restart, found at the floor: real torchrun jobs
(c10d rendezvous, `--max-restarts 2`), a DeepSpeed ZeRO-2 CPU job saving a flash checkpoint every
step, and `diag agent --on-hang stop` with its default limits (bench/early_fault.py).

Rank 1 stops after its 5th step of each of the first two attempts, before its flash save; rank 0
then waits in the save's agreement, inside its "checkpoint" phase. The verdict's limit must be
the floor (10 s by default), not the 80% of the 60 s collective timeout that the phase's 30-minute
limit was capped at. No wall-time assertion: the limit and its basis say it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from repo import BENCH

sys.path.insert(0, str(BENCH))
import early_fault

FLOOR = 10.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hangs_in_the_first_steps_of_a_launch_and_of_a_restart_are_found_at_the_floor(
    tmp_path: Path,
) -> None:
    res = early_fault.run(tmp_path, hang_step=5, hang_attempts="0,1", hang_where="save")
    if res.rc != 0 and "EADDRINUSE" in res.log:
        # torch's elastic agent picks its ranks' store port by binding port 0 and closing it; on
        # a machine busy with other jobs' connections that port can be taken before the ranks
        # bind it. Not what this test is about: once more, in a fresh directory.
        (tmp_path / "again").mkdir()
        res = early_fault.run(
            tmp_path / "again", hang_step=5, hang_attempts="0,1", hang_where="save"
        )
    assert res.rc == 0, res.log
    assert [f.attempt for f in res.faults] == [0, 1], res.log
    for f in res.faults:
        v = f.verdict
        assert v.get("culprit") == 1, v
        waiter = [o for o in v["overdue"] if o["rank"] == 0]
        assert waiter, v
        assert waiter[0]["limit_s"] == FLOOR, waiter
        basis = waiter[0]["limit_basis"]
        assert basis.startswith("floor (5 x slowest step/op since warm-up"), basis
        assert "waiting in phase 'checkpoint'" in basis, basis
        assert f.first_step_at is not None, res.log  # the restarted ranks trained again
