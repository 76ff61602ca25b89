"""`diag demo`'s flags: each explained, readable before anything is installed (scripts/demo.sh
--help must not set up 1.8 GB first), and the demo's report says why a job it faulted exits 1."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

from repo import ROOT

from diag.cli import demosettings
from diag.cli.demo import DemoResult, _job_rc_meaning, report
from diag.formats.exitcodes import HANG_DETECTED
from diag.trainer import demo_job


def test_every_demo_flag_has_help_and_the_faults_are_the_jobs() -> None:
    parser = argparse.ArgumentParser()
    demosettings.add_arguments(parser)
    bare = [a.option_strings for a in parser._actions if not a.help]
    assert bare == [], bare
    assert demosettings.FAULTS == demo_job.FAULTS


def test_demo_help_needs_nothing_installed(tmp_path: Path) -> None:
    """The script's `--help` runs on the bare interpreter (no venv: no torch, psutil or grpc),
    and does not bootstrap first."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(sys._base_executable)  # type: ignore[attr-defined]
    env = {"PATH": f"{bare}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [str(ROOT / "scripts/demo.sh"), "--steps", "3", "--help"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage: diag demo" in proc.stdout and "--fault-step" in proc.stdout, proc.stdout
    assert "the rank the fault is injected in" in proc.stdout
    assert "bootstrap" not in proc.stdout + proc.stderr


def test_the_report_says_why_a_faulted_job_exits_1(tmp_path: Path) -> None:
    """After a hang or a killed rank torchrun's 1 is the expected end: the report says so beside
    the number, and what the agent's 3 means."""
    incident = [tmp_path / "incident"]
    stopped = DemoResult(workdir=tmp_path, agent_rc=0, job_rc=1, incidents=incident)
    hang, killed = (
        demosettings.DemoSettings(),
        demosettings.DemoSettings(fault="exit", fault_rank=3),
    )
    assert "the agent stopped the ranks" in _job_rc_meaning(hang, stopped)
    assert "rank 3 was killed" in _job_rc_meaning(killed, stopped)
    clean = DemoResult(workdir=tmp_path, agent_rc=0, job_rc=0)
    assert _job_rc_meaning(demosettings.DemoSettings(fault="none"), clean) == ""
    unexplained = DemoResult(workdir=tmp_path, agent_rc=0, job_rc=1)  # failed with no incident
    assert _job_rc_meaning(hang, unexplained) == ""
    out = io.StringIO()
    report(hang, stopped, out)
    first = out.getvalue().strip().splitlines()[0]
    assert first.startswith("job exit code 1 (expected: the agent stopped the ranks"), first
    assert "agent exit code 0," in first, first
    out = io.StringIO()
    report(
        hang,
        DemoResult(workdir=tmp_path, agent_rc=HANG_DETECTED, job_rc=1, incidents=incident),
        out,
    )
    assert "agent exit code 3 (an incident detected and handled)" in out.getvalue()
