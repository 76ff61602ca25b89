"""A restore from memory copies each file of the step out of the slots once: DeepSpeed's state-dict
loader opens the model states twice (once for their keys), and the second is served from the copy
already read (2 ranks, gloo, ZeRO 2 and 3)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jobrun
import pytest
from repo import SUPPORT, pythonpath

JOB = SUPPORT / "jobs" / "restore_reads_job.py"


@pytest.mark.slow
def test_each_file_is_copied_out_of_the_slots_once() -> None:
    out = Path(tempfile.mkdtemp(prefix="diag-test-reads-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-reads-run-", dir="/dev/shm"))
    try:
        env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
                   PYTHONPATH=pythonpath(os.environ.get("PYTHONPATH", "")))  # fmt: skip
        cmd = jobrun.command(2, JOB, "--zero", "2,3", "--out", str(out))
        rc = jobrun.run(cmd, out / "job.log", env, 300)
        assert rc == 0, (out / "job.log").read_text(errors="replace")[-4000:]
        for zero in (2, 3):
            for rank in (0, 1):
                got = json.loads((out / f"reads-z{zero}-{rank}.json").read_text())
                assert got["step"] == 2 and got["from"] == "memory", got
                assert got["copies"], got  # the load did copy its files out of the slots
                assert set(got["copies"].values()) == {1}, (zero, rank, got["copies"])
                if zero == 2:  # the model states: every rank loads them, DeepSpeed twice
                    assert any("model_states" in f for f in got["copies"]), got
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
