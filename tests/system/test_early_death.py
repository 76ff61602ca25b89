"""Ranks that die before the agent first looks at them, with real rank processes (journaled by
`diag.trainer.attach`, holding flash-checkpoint snapshots in shared memory) and the agent's own
loop, driven one observation at a time: the agent looks once (nothing there yet), the ranks start,
snapshot step 4 and are SIGKILLed, and only then does the agent look again. None of their PIDs is
visible any more, so nothing proves the PID namespace is shared but the journals themselves; the
agent must still declare the deaths, name the rank that went silent first, and persist the
snapshots, so that step 4 is committed."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from snapshot_helpers import captured, model_states, write_snapshot

from diag.agent.config import agentconfig as config
from diag.agent.detect.hang import EventKind, VerdictKind
from diag.agent.detect.observation import Liveness
from diag.agent.loop.daemon import Agent
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import read_latest_step, slot_path

pytestmark = pytest.mark.timeout(120)

JOB = "early"
WORLD = 2
STEP = 4


def _rank(run_dir: str, save_dir: str, rank: int, ready, silent_first) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD), DIAG_CONTROL="0",
    )  # fmt: skip
    import diag.trainer

    diag.trainer.attach(run_dir=run_dir, job=JOB)
    slot = SlotFile.create(
        slot_path(Path(run_dir), JOB, rank, 0), 8 << 20, job=JOB, rank=rank, world_size=WORLD,
        local_rank=rank, slot=0, writer_pid=os.getpid(),
        writer_start=psutil.Process().create_time(),
    )  # fmt: skip
    files = {
        f"global_step{STEP}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": model_states(rank)
    }
    if rank == 0:
        files[f"global_step{STEP}/mp_rank_00_model_states.pt"] = model_states(STEP)
    write_snapshot(
        slot, STEP, captured(files), job=JOB, rank=rank, world=WORLD, save_dir=Path(save_dir)
    )
    if rank != 1:
        silent_first.wait(60)  # rank 1 goes silent first; this one's journal moves after it
    for n in range(1, STEP + 1):
        diag.trainer.step(n)
    ready.set()
    time.sleep(120)  # until the test kills it


def test_ranks_dead_before_the_first_look_are_declared_and_persisted() -> None:
    root = Path(tempfile.mkdtemp(prefix="diag-test-early-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-early-run-", dir="/dev/shm"))
    save_dir = root / "ckpt"
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(
        ["--run-dir", str(run_dir), "--timeline", str(root / "timeline"), "--job", JOB,
         "--node", "node-a", "--native-stacks", "false", "--control", "false"]
    )  # fmt: skip
    cfg = config.load(args, env={})
    agent = Agent(cfg)
    ctx = mp.get_context("spawn")
    procs = []
    try:
        assert agent.step(time.monotonic()) == []  # the first look: no rank yet
        silent_first = ctx.Event()
        for rank in (1, 0):
            ready = ctx.Event()
            p = ctx.Process(
                target=_rank, args=(str(run_dir), str(save_dir), rank, ready, silent_first),
                daemon=True,
            )  # fmt: skip
            p.start()
            procs.append(p)
            assert ready.wait(90), f"rank {rank} did not start"
            silent_first.set()
        for p in procs:  # rank 1 first, as a launcher tears the rest down after a death
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)

        kinds = agent.step(time.monotonic())  # the first look at these ranks: both gone

        obs = agent.observer.observe(time.monotonic())
        assert {r.rank: r.liveness for r in obs.ranks} == {0: Liveness.DIED, 1: Liveness.DIED}
        assert EventKind.INCIDENT in kinds
        verdict = agent.executor.reports[-1].verdict
        assert verdict.kind == VerdictKind.RANK_EXITED
        assert verdict.culprit == 1, verdict.summary
        # Persisted before anything else, from the snapshots the dead ranks left in memory.
        assert read_latest_step(save_dir) == STEP
        assert (save_dir / "dlrover_latest.txt").read_text() == str(STEP)
        assert sorted(p.name for p in (save_dir / f"global_step{STEP}").iterdir()) == [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        agent.checkpoints.close(timeout=30)
        agent.observer.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
