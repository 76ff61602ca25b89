"""The fast tier holds no job: a test that would run in it and starts one fails, saying what to do
(tests/support/fasttier.py, armed by tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fasttier

TESTS = Path(__file__).resolve().parents[1]

CASES = """
import subprocess, sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("tiny_job.py")


def test_unmarked_test_that_starts_a_job():
    subprocess.run([sys.executable, str(JOB)], check=True, timeout=60)


@pytest.mark.slow
def test_slow_test_that_starts_a_job():
    subprocess.run([sys.executable, str(JOB)], check=True, timeout=60)


def test_timed_test_that_starts_a_job():
    subprocess.run([sys.executable, str(JOB)], check=True, timeout=60)


def test_unmarked_test_that_starts_a_tool():
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
"""


def test_a_job_started_by_a_fast_tier_test_fails_it(tmp_path: Path) -> None:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "tiny_job.py").write_text("print('a job script of tests/support')\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    timed = "test_cases.py::test_timed_test_that_starts_a_job"
    (tmp_path / "durations.json").write_text(json.dumps({timed: 30.0}))
    env = {**os.environ, "PYTHONPATH": str(TESTS / "support")}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    # The test itself ran; its teardown fails it. The marked, the timed and the tool pass.
    assert "4 passed" in text and "1 error" in text, text
    assert "ERROR at teardown of test_unmarked_test_that_starts_a_job" in text, text
    assert (
        "test_cases.py::test_unmarked_test_that_starts_a_job starts a job (tiny_job.py) but "
        "would run in the fast tier: mark it @pytest.mark.slow" in text
    ), text


def test_what_counts_as_a_job() -> None:
    for argv in (
        ["/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"],
        [sys.executable, "-m", "torch.distributed.run", "train.py"],
        [sys.executable, "-m", "diag.trainer.demo_job"],
        ["deepspeed", "train.py"],
        [sys.executable, "/repo/tests/support/jobs/flash_job.py", "--steps", "3"],
    ):
        assert fasttier.job_in(argv) is not None, argv
    for argv in (
        [sys.executable, "-c", "import torch"],
        ["py-spy", "dump", "--pid", "1"],
        ["promtool", "check", "metrics"],
        [sys.executable, "/repo/tests/support/jobs/jobrun.py"],
    ):
        assert fasttier.job_in(argv) is None, argv
