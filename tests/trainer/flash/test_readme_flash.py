"""The flash-checkpoint example of the README's quick start (the same lines as the docs' Flash
checkpoints page; tests/docs/test_docs_examples.py keeps the three in step) survives a SIGKILL: a
real 2-rank DeepSpeed job (torchrun, gloo on CPU) runs the example exactly as documented, without
`attach` (so no op journal: the checkpointer's registration over the control channel is all the
agent knows of the ranks), next to a real `diag agent` started as the README's quick start shows.
Rank 1 is SIGKILLed in step 12; the save of step 10 asked for a persist, step 11 was saved to
memory only. The agent sees the death through the registered PID and persists what the ranks left
in memory: step 10 is on storage, committed, and stock DeepSpeed loads it; the dead rank's newest
snapshot (step 11) is on storage too, and `latest` names the newest step every rank held complete
in memory at the kill. Without the death being seen, only the requested step 10 would be there."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from flash_launch import wait_for
from jobrun import free_port
from repo import SUPPORT

from diag.agent.checkpoint.storage import done_ranks
from diag.agent.observe.procs import stop_tree
from diag.formats.rundir import control_socket_path
from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import find_slots, read_latest_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB_SCRIPT = SUPPORT / "jobs" / "readme_flash_job.py"


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
        str(JOB_SCRIPT), *args,
    ]  # fmt: skip


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout)
        finally:
            if proc.poll() is None:
                stop_tree(proc.pid, grace=5)
                proc.wait(10)


def test_readme_example_without_attach_survives_a_sigkill() -> None:
    root = Path(tempfile.mkdtemp(prefix="diag-test-readme-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-readme-run-", dir="/dev/shm"))
    save_dir = root / "ckpt"
    env = dict(
        os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", TMPDIR=str(root),
        DIAG_JOB="readme",
    )  # fmt: skip
    agent_log = root / "agent.log"
    # The README's quick-start command line (run dir and timeline of this test).
    agent_cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
        "--timeline", str(root / "timeline"), "--trainer-uid", str(os.geteuid()),
        "--hang-timeout", "300", "--on-hang", "stop", "-v",
    ]  # fmt: skip
    with open(agent_log, "wb") as out:
        agent = subprocess.Popen(agent_cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_for(control_socket_path(run_dir, "readme").exists, 60), agent_log.read_text()
        job_log = root / "job.log"
        rc = _run(_torchrun(str(save_dir), "--steps", "14", "--kill-step", "12"), env, job_log, 300)
        assert rc != 0, "the killed job must fail\n" + job_log.read_text()[-3000:]

        # What the ranks left in memory: rank 1 holds steps 10 and 11 (its copy of 11 finished
        # before engine.step of 12 returned); rank 0 saved 12 over 10 or over 11, depending on
        # whether the agent had acknowledged 10 by then.
        memory: dict[int, set[int]] = {0: set(), 1: set()}
        for snap in read_snapshots(find_slots(run_dir)):
            memory[snap.meta.rank].add(snap.meta.step)
        assert {10, 11} <= memory[1], memory
        newest_common = max(memory[0] & memory[1])

        def persisted() -> bool:
            return (
                read_latest_step(save_dir) == newest_common
                and done_ranks(save_dir, 10) == {0, 1}
                and 1 in done_ranks(save_dir, 11)  # the dead rank's newest, persisted after death
            )

        assert wait_for(persisted, 60), (
            f"latest={read_latest_step(save_dir)} (memory: {memory}), ranks on storage: step 10 "
            f"{sorted(done_ranks(save_dir, 10))}, step 11 {sorted(done_ranks(save_dir, 11))}\n"
            + agent_log.read_text()[-4000:]
        )
        assert (save_dir / "dlrover_latest.txt").read_text() == str(newest_common)
        assert sorted(p.name for p in (save_dir / "global_step10").iterdir()) == [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
        log = agent_log.read_text()
        assert "died without closing its flash checkpointer" in log, log[-4000:]

        # Stock DeepSpeed (a new node: nothing in memory) loads step 10 from storage.
        shutil.rmtree(run_dir, ignore_errors=True)
        load_env = dict(env, DIAG_CONTROL="0", DIAG_RUN_DIR=str(root / "empty-run"))
        rc = _run(_torchrun(str(save_dir), "--stock-load", "global_step10"), load_env, job_log, 300)
        assert rc == 0, job_log.read_text()[-3000:]
        for rank in (0, 1):
            loaded = json.loads((root / f"loaded-rank{rank}.json").read_text())
            assert loaded["path"] is not None and loaded["global_steps"] == 10, loaded
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
