"""The interruptible wait of in-place recovery on gloo (diag.trainer.resilient.waiting), with two
real gloo processes: gloo's abort leaves a blocked wait where it is, so a signal must end it; the
aborted world's groups are kept while the abandoned work runs (freeing them would block the
thread that drops them) and freed once it has ended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jobrun
import pytest
from repo import JOBS


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_signal_ends_a_blocked_gloo_wait_and_the_group_is_freed_after_its_work(
    tmp_path: Path,
) -> None:
    port = str(jobrun.free_port())
    job = str(JOBS / "waiting_job.py")
    peer = subprocess.Popen([sys.executable, job, "1", port, str(tmp_path)])
    try:
        done = subprocess.run(
            [sys.executable, job, "0", port, str(tmp_path)],
            capture_output=True, text=True, timeout=100, check=False,
        )  # fmt: skip
        assert peer.wait(30) == 0
    finally:
        jobrun.stop(peer)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["interrupted"], result  # the wait ended while rank 1 still ran
    assert result["kept_while_abandoned"] >= 2, result  # the default group and the new one
    assert result["freed"], result
    assert result["restored"] != "function", result  # Work.wait is torch's own again
