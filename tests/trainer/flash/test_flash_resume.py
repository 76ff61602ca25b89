"""Flash checkpoints end to end with real 2-rank DeepSpeed jobs (gloo, CPU), a real agent and a
real control channel:

- a rank is SIGKILLed (after a save, or in the middle of the memory copy), the agent persists the
  newest complete snapshot before acting, the job is relaunched and continues: losses and
  parameters match an uninterrupted run bit for bit, for ZeRO 1, 2 and 3 (3 in bf16);
- stock `engine.load_checkpoint` reads what the agent persisted, with the same result;
- the agent's FLUSH, DUMP and EXIT commands reach a running job and are carried out.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from flash_launch import Workspace, assert_same, wait_for

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.service import ControlServer
from diag.agent.checkpoint.sessions import CommandKind
from diag.agent.checkpoint.storage import marker_path
from diag.agent.observe.procs import stop_tree
from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import find_slots, read_latest_step
from diag.formats.stackdump import RankDump


@pytest.fixture
def ws():
    root = Path(tempfile.mkdtemp(prefix="diag-test-flash-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-flash-run-", dir="/dev/shm"))
    try:
        yield Workspace(root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def agent_process(ws: Workspace):
    procs: list[subprocess.Popen] = []

    def start(job: str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(ws.run_dir),
            "--job", job, "--timeline", str(ws.root / "timeline"), "--native-stacks", "false",
            "--interval", "0.25", "-v",
        ]  # fmt: skip
        log = open(ws.root / "agent.log", "ab")  # noqa: SIM115 - the process owns it
        proc = subprocess.Popen(cmd, env=ws.env(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        procs.append(proc)
        socket = control_socket_path(ws.run_dir, job)
        assert wait_for(socket.exists, 30), (ws.root / "agent.log").read_text()
        return proc

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


BF16 = ("--bf16-stages", "3")  # ZeRO-3 trains in bf16, the others in fp32

# stage -> (kill mode, kill step, the step that must be committed afterwards)
KILLS = {
    1: ("after-save", 3, 3),  # both ranks hold step 3: the agent persists it
    2: ("mid-copy", 3, 2),  # rank 1 dies copying step 3: step 2 is the newest complete one
    3: ("mid-copy", 4, 3),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_persist_relaunch_matches_uninterrupted_run(ws: Workspace, agent_process) -> None:
    assert ws.launch("base", "--zero", "1,2,3", *BF16, "--no-flash") == 0, ws.log("base")

    for zero, (mode, step, committed) in KILLS.items():
        agent = agent_process(f"flash-z{zero}")
        extra = ["--persist-every", "2"] if zero == 1 else []  # the request path too
        rc = ws.launch(
            f"kill{zero}", "--zero", str(zero), *BF16, "--attach", "--kill-step", str(step),
            "--kill-mode", mode, *extra,
        )  # fmt: skip
        assert rc != 0, f"the killed job must fail\n{ws.log(f'kill{zero}')}"
        save = ws.save / f"z{zero}"
        assert wait_for(lambda s=save, c=committed: read_latest_step(s) == c, 60), (
            f"ZeRO-{zero}: latest={read_latest_step(save)}\n"
            + (ws.root / "agent.log").read_text()[-3000:]
        )
        assert (save / "dlrover_latest.txt").read_text() == str(committed)
        if mode == "mid-copy":
            # The torn snapshot of rank 1 never reaches storage.
            assert not marker_path(save, step, 1).exists()
            assert not list((save / f"global_step{step}").glob("*rank_1_*"))
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0

    # Relaunch: every rank finds the newest step all ranks hold complete in shared memory.
    assert ws.launch("mem", "--zero", "1,2,3", *BF16, "--no-control") == 0, ws.log("mem")
    for zero, (_, _, committed) in KILLS.items():
        assert ws.start("mem", zero) == {"step": committed, "from": "memory"}
        assert_same(ws, "mem", zero, committed)
    assert find_slots(ws.run_dir) == [], "a clean exit removes the shared memory"

    # A new node has nothing in memory: stock DeepSpeed loads what the agent persisted.
    rc = ws.launch("stock", "--zero", "1,2,3", *BF16, "--no-flash", "--stock-load")
    assert rc == 0, ws.log("stock")
    for zero, (_, _, committed) in KILLS.items():
        assert ws.start("stock", zero)["step"] == committed
        assert_same(ws, "stock", zero, committed)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flush_dump_and_exit_commands(ws: Workspace) -> None:
    job = "cmd-z2"
    manager = CheckpointManager(ws.run_dir, None)
    server = ControlServer(control_socket_path(ws.run_dir, None), manager).start()
    with open(ws.root / "cmd.log", "wb") as log:
        proc = subprocess.Popen(
            ws.command("--out", str(ws.root / "cmd"), "--zero", "2", "--job-prefix", "cmd",
                       "--wait-commands", "0.05", "--steps", "1000"),
            env=ws.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        assert wait_for(lambda: manager.connected(job) == [0, 1], 120), ws.log("cmd")

        dumps = manager.send_command(job, CommandKind.DUMP, dump_dir=str(ws.run_dir / "dump"))
        reports = manager.wait_reports(list(dumps.values()), 30)
        assert sorted(r.rank for r in reports.values()) == [0, 1]
        for r in reports.values():
            assert r.ok, r.detail
            frames = {f.func for t in RankDump.load(Path(r.path)).threads for f in t.frames}
            assert "run_stage" in frames, "the training thread's stack is in the dump"

        # FLUSH reaches rank 1 only; rank 0 saves at the same step (the flags are all-reduced).
        (cid,) = manager.send_command(job, CommandKind.FLUSH, [1]).values()
        report = manager.wait_reports([cid], 60)[cid]
        assert report.ok, report.detail
        save = ws.save / "z2"
        assert wait_for(lambda: read_latest_step(save) == report.step, 60)
        assert sorted(p.name for p in (save / f"global_step{report.step}").iterdir()) == [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]

        # EXIT reaches rank 0 only; both ranks flush and leave at the same step.
        (cid,) = manager.send_command(job, CommandKind.EXIT, [0], exit_code=0).values()
        assert proc.wait(90) == 0, ws.log("cmd")
        report = manager.wait_reports([cid], 10)[cid]
        assert report.ok and report.step > 0
        # The ranks leave inside engine.step of that step, before the script logs its loss.
        assert max(ws.losses("cmd", 2)) == report.step - 1
        assert wait_for(lambda: read_latest_step(save) == report.step, 60)
        # The ranks left their snapshots to the agent; with nothing left to persist it removes
        # them.
        assert wait_for(
            lambda: not manager.tick(time.monotonic()) and not find_slots(ws.run_dir), 30
        )
    finally:
        if proc.poll() is None:
            stop_tree(proc.pid, grace=5)
            proc.wait(10)
        server.stop()
        manager.close(timeout=30)
