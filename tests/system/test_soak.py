"""A few minutes of the soak (bench/soak.py) on real jobs and real agents with their default
limits: healthy jobs with every irregularity of the mix raise no incident, and one fault of each
kind the agent knows is detected, named and attributed to the rank it was injected on."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from repo import BENCH

sys.path.insert(0, str(BENCH))
import soak

# The long tier: each fault kind has its own test in the default tier (tests/system/
# test_agent_faults.py, tests/agent/detect/test_deadlocks.py, tests/trainer/test_stepless.py), and
# so do the irregularities of a healthy job (stragglers, eval phases, slow first steps); the soak
# mixes them for minutes on a node kept busy on purpose.
pytestmark = [pytest.mark.slow, pytest.mark.long]

# Two jobs that together hold every irregularity the soak draws from.
MIXES = (
    soak.Mix(
        seed=1, nproc=3, zero=2, seconds=120, first_step_delay=20.0, straggler_rank=2,
        straggle=0.6, stall_prob=0.08, stall_max=4.0, eval_every=15, eval_seconds=20.0,
        flash_every=5, persist_every=2, save_every=0,
    ),
    soak.Mix(
        seed=2, nproc=2, zero=3, seconds=120, first_step_delay=0.0, straggler_rank=-1,
        straggle=0.0, stall_prob=0.1, stall_max=4.0, eval_every=0, eval_seconds=0.0,
        flash_every=0, persist_every=2, save_every=10,
    ),
)  # fmt: skip


@pytest.mark.timeout(600)
def test_healthy_irregular_jobs_raise_no_incident(tmp_path: Path) -> None:
    with soak.noisy_neighbour(1):
        runs = [soak.start_job(m, tmp_path / f"job{i}") for i, m in enumerate(MIXES)]
        try:
            deadline = time.monotonic() + 500
            pending = list(runs)
            while pending and time.monotonic() < deadline:
                pending = [r for r in pending if not r.poll()]
                time.sleep(1)
        finally:
            for r in runs:
                r.stop()
    for r in runs:
        found = soak.incidents(r.root / "timeline")
        assert not found, [(d / "verdict.json").read_text() for d in found]
        log = (r.root / "job.log").read_text(errors="replace")
        assert r.job.returncode == 0, log[-3000:]
        assert "soak_job: done" in log
    # The mix really ran: eval phases, stalls, persisted flash checkpoints, DeepSpeed checkpoints.
    first = (runs[0].root / "job.log").read_text(errors="replace")
    assert "soak_job rank 0: eval" in first and "straggling from" in first
    assert "data-loader stall" in (runs[1].root / "job.log").read_text(errors="replace")
    assert list((runs[0].root / "ckpt" / "flash").glob("*")), "no flash checkpoint persisted"
    assert list((runs[1].root / "ckpt" / "ds").glob("s*")), "no DeepSpeed checkpoint saved"


@pytest.mark.timeout(900)
def test_each_injected_fault_kind_is_detected_named_and_attributed(tmp_path: Path) -> None:
    # Three trials at a time, as in the bench run: a fault must be found on a busy node too.
    ranks = {k.name: {"p2p": 2, "pipeline": 1}.get(k.name, 3) for k in soak.FAULT_KINDS}
    with ThreadPoolExecutor(3) as pool:
        trials = list(
            pool.map(lambda k: soak.run_trial(k, ranks[k], 4, tmp_path / k, seed=3), ranks)
        )
    wrong = [t for t in trials if not (t.ok and t.seconds is not None and t.seconds > 0)]
    assert not wrong, "\n".join(f"{t.kind} rank {t.rank}: {t}" for t in wrong)
    assert {t.kind for t in trials} == {k.name for k in soak.FAULT_KINDS}
