"""Runs tests/support/jobs/wait_job.py under torchrun next to a real `diag agent` process and collects what the
agent decided (shared by the wait-for-cycle and stepless end-to-end tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jobrun import free_port

from diag.agent.observe.procs import stop_tree

JOB_SCRIPT = Path(__file__).with_name("wait_job.py")
JOB = "waits"


@dataclass
class WaitRun:
    root: Path
    agent_rc: int | None
    verdicts: list[dict] = field(default_factory=list)

    @property
    def verdict(self) -> dict:
        assert self.verdicts, "no incident: " + self.agent_log()[-3000:]
        return self.verdicts[0]

    def agent_log(self) -> str:
        return (self.root / "agent.log").read_text(errors="replace")

    def job_log(self) -> str:
        return (self.root / "job.log").read_text(errors="replace")

    def fault_wall(self) -> float:
        """Wall-clock time at which the job logged its fault."""
        m = re.search(r"wait_job rank \d+: .* at (\d+\.\d+)", self.job_log())
        assert m, self.job_log()[-2000:]
        return float(m.group(1))


def run(
    root: Path,
    scenario: str,
    *,
    nproc: int = 4,
    job_args: tuple[str, ...] = (),
    agent_args: tuple[str, ...] = (),
    timeout: float = 150.0,
) -> WaitRun:
    """Starts the agent (until its first incident, stopping the ranks then) and the job; returns
    once the agent has exited, or after `timeout` seconds, with everything stopped."""
    run_dir, timeline = root / "run", root / "timeline"
    for d in (run_dir, timeline, root / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_JOB=JOB, OMP_NUM_THREADS="1",
        TMPDIR=str(root / "tmp"),
    )  # fmt: skip
    py = sys.executable
    agent_cmd = [
        py, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir), "--timeline",
        str(timeline), "--job", JOB, "--on-hang", "stop", "--until", "incident", "--interval",
        "0.25", "--stop-grace", "5", "--native-stacks", "false", "-v",
        *agent_args,
    ]  # fmt: skip
    job_cmd = [
        py, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
        "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0", str(JOB_SCRIPT),
        "--scenario", scenario, *job_args,
    ]  # fmt: skip
    with open(root / "agent.log", "wb") as alog, open(root / "job.log", "wb") as jlog:
        agent = subprocess.Popen(
            agent_cmd, env=env, stdout=alog, stderr=subprocess.STDOUT, start_new_session=True
        )
        job = subprocess.Popen(
            job_cmd, env=env, stdout=jlog, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and agent.poll() is None:
                time.sleep(0.2)
        finally:
            for proc in (job, agent):
                if proc.poll() is None:
                    stop_tree(proc.pid, grace=5)
                proc.wait(timeout=20)
    result = WaitRun(root=root, agent_rc=agent.returncode)
    for d in sorted(timeline.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and (d / "verdict.json").exists():
            result.verdicts.append(json.loads((d / "verdict.json").read_text()))
    return result
