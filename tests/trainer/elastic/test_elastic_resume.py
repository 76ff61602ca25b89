"""Resume at another world size, end to end: a DeepSpeed job with an elastic config runs under
torchrun at 4 ranks, then 2, then 3 (ZeRO 3, and 1 and 2 in the long tier, one after the other in
the same processes), each time persisting its last step through the flash checkpointer and a real
agent. Every restart keeps the global batch, resumes from the persisted step through
`FlashCheckpointer.load()` (which converts it with DeepSpeed's universal checkpoint converter),
and its losses continue those of an uninterrupted run.

Tolerance: the runs compute the same global batch, but the sums inside it (micro batches,
gradient accumulation, gloo's all-reduce) are grouped differently at each size, so float32
rounding differs: we saw relative differences up to ~1e-7. We allow 1e-5, a hundred times that
and still tight: a resume from another step would be off by more than 1e-3 (consecutive losses of
the run differ by that much at least, checked below), and one that lost Adam's moments changes
every later update by a fraction of the learning rate (1e-2), not by rounding.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jobrun
import pytest
from repo import SUPPORT

from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import read_latest_step

JOB = SUPPORT / "jobs" / "elastic_job.py"
# The default tier resizes ZeRO 3 through the flash checkpoint; ZeRO 2 is resized from storage
# by the drained test below and by test_hf_callbacks; the long tier runs every stage here.
STAGES = (1, 2, 3)
DEFAULT_STAGES = (3,)
RTOL = 1e-5
# (ranks, train up to this step)
RUNS = ((4, 3), (2, 6), (3, 9))
# ranks -> (micro batch, gradient accumulation) for the global batch of 12 (elastic_job.ELASTIC)
SPLITS = {4: (3, 1), 2: (3, 2), 3: (2, 2)}


def _wait(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return pred()


@pytest.fixture
def ws():
    root = Path(tempfile.mkdtemp(prefix="diag-test-elastic-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-elastic-run-", dir="/dev/shm"))
    try:
        yield root, run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _env(run_dir: Path) -> dict[str, str]:
    return dict(os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")


def _command(root: Path, name: str, nproc: int, *args: str) -> list[str]:
    return jobrun.command(
        nproc, JOB, "--save-dir", str(root / "ckpt"), "--out", str(root / name), *args
    )


def _launch(root: Path, run_dir: Path, name: str, nproc: int, *args: str) -> int:
    return jobrun.run(_command(root, name, nproc, *args), root / f"{name}.log", _env(run_dir))


def _log(root: Path, name: str) -> str:
    return (root / f"{name}.log").read_text(errors="replace")[-4000:]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _losses(path: Path) -> dict[int, tuple[float, int]]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: (r["loss"], r["world"]) for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_restarts_at_4_2_3_ranks_keep_the_batch_and_continue_the_loss(ws, long_tier) -> None:  # type: ignore[no-untyped-def]
    root, run_dir = ws
    stages = STAGES if long_tier else DEFAULT_STAGES
    last = RUNS[-1][1]
    assert (
        _launch(root, run_dir, "base", 2, "--zero", "2", "--steps", str(last), "--no-flash") == 0
    ), _log(root, "base")
    base = _losses(root / "base" / "z2" / "loss.jsonl")
    assert sorted(base) == list(range(1, last + 1))
    steps = [base[s][0] for s in sorted(base)]
    assert min(abs(a - b) for a, b in itertools.pairwise(steps)) > 1e-3  # so the check can tell

    agent_log = open(root / "agent.log", "ab")  # noqa: SIM115 - the agent owns it
    agent = subprocess.Popen(
        [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
         "--timeline", str(root / "timeline"), "--native-stacks", "false", "--interval", "0.25"],
        env=_env(run_dir), stdout=agent_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    agent_log.close()
    try:
        assert _wait(control_socket_path(run_dir, None).exists, 60), (
            root / "agent.log"
        ).read_text()
        previous = 0
        for nproc, upto in RUNS:
            name = f"n{nproc}"
            zeros = ",".join(map(str, stages))
            rc = _launch(root, run_dir, name, nproc, "--zero", zeros, "--steps", str(upto))
            assert rc == 0, _log(root, name)
            for zero in stages:
                save = root / "ckpt" / f"z{zero}"
                assert _wait(lambda s=save, u=upto: read_latest_step(s) == u, 120), (
                    f"ZeRO-{zero}: the agent did not commit step {upto}; latest is "
                    f"{read_latest_step(save)}\n" + (root / "agent.log").read_text()[-3000:]
                )
                out = root / name / f"z{zero}"
                plan = _json(out / "plan.json")
                assert plan["world_size"] == nproc
                assert plan["train_batch_size"] == 12, "the global batch is kept"
                assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (
                    SPLITS[nproc]
                )
                start = _json(out / "start.json")
                assert start["step"] == previous and start["global_steps"] == previous
                if previous:
                    # Saved at the previous run's size: loaded from storage, resharded.
                    assert start["from"] == "storage", start
                    assert start["resharded_from"] == RUNS[RUNS.index((nproc, upto)) - 1][0]
                    assert (save / ".diag" / "universal" / f"global_step{previous}").is_dir()
                got = _losses(out / "loss.jsonl")
                assert sorted(got) == list(range(previous + 1, upto + 1))
                for step, (loss, world) in got.items():
                    assert world == nproc
                    assert math.isclose(loss, base[step][0], rel_tol=RTOL), (
                        f"ZeRO-{zero} at {nproc} ranks, step {step}: loss {loss} vs "
                        f"{base[step][0]} uninterrupted"
                    )
            previous = upto
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(10)


# -- the same through drains, without an agent ---------------------------------------------------

DRAIN_LAST = 60


def _start(root: Path, run_dir: Path, name: str, nproc: int, *args: str) -> subprocess.Popen:
    # The stop file is touched with ~57 steps of ~0.15 s left: the default 10 s bound on the
    # stop latency would let a run whose agreements got costly (a busy machine) finish first.
    env = dict(_env(run_dir), DIAG_STOP_MAX_LATENCY="2")
    return jobrun.start(_command(root, name, nproc, *args), root / f"{name}.log", env)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_drained_at_4_then_2_then_resumed_at_3_ranks_keeps_the_batch(ws, long_tier) -> None:  # type: ignore[no-untyped-def]
    """No agent, no flash checkpointer: a ZeRO-2 job at 4 ranks is stopped by the stop file in
    the middle of training and saves with `engine.save_checkpoint`; relaunched at 2 ranks it
    resumes from that step (resharded), keeps the global batch, is stopped again; at 3 ranks it
    resumes and finishes. Every logged loss continues the uninterrupted run's. The default tier
    goes from 4 ranks straight to 3 (the test above resizes through 2 as well)."""
    root, run_dir = ws
    assert _launch(root, run_dir, "base", 2, "--zero", "2", "--steps", str(DRAIN_LAST),
                   "--no-flash") == 0, _log(root, "base")  # fmt: skip
    base = _losses(root / "base" / "z2" / "loss.jsonl")
    stop = root / "stop"
    save = root / "ckpt" / "z2"
    common = ("--zero", "2", "--drain", "--stop-file", str(stop), "--steps", str(DRAIN_LAST))
    previous, sizes = 0, (4, 2, 3) if long_tier else (4, 3)
    for i, nproc in enumerate(sizes):
        name = f"d{nproc}"
        stopping = i < len(sizes) - 1
        proc = _start(
            root, run_dir, name, nproc, *common, "--step-sleep", "0.1" if stopping else "0"
        )
        loss_file = root / name / "z2" / "loss.jsonl"
        try:
            if stopping:
                # Stop it once it trained 3 steps of its own.
                assert _wait(lambda f=loss_file: f.exists() and len(_losses(f)) >= 3, 240), _log(
                    root, name
                )
                stop.touch()
                touched = f"touched the stop file after step {max(_losses(loss_file))}"
            rc = proc.wait(240)
        finally:
            jobrun.stop(proc)
        out = root / name / "z2"
        start = _json(out / "start.json")
        assert start["step"] == previous and start["global_steps"] == previous, start
        if previous:
            assert start["resharded_from"] == sizes[i - 1], start
        plan = _json(out / "plan.json")
        assert plan["train_batch_size"] == 12, "the global batch is kept"
        assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == SPLITS[nproc]
        got = _losses(loss_file)
        if stopping:
            assert rc != 0, (
                f"a drained run reported success at {nproc} ranks ({touched}; logged steps "
                f"{min(got)}-{max(got)}; stop file left: {stop.exists()}): {_log(root, name)}"
            )
            assert "exitcode  : 143" in _log(root, name), _log(root, name)
            saved = read_latest_step(save)
            assert saved is not None and saved > max(got) and saved < DRAIN_LAST, (saved, got)
            assert not stop.exists()
        else:
            assert rc == 0, _log(root, name)
            saved = DRAIN_LAST
            assert max(got) == DRAIN_LAST
        assert sorted(got) == list(range(previous + 1, max(got) + 1))
        for step, (loss, world) in got.items():
            assert world == nproc
            assert math.isclose(loss, base[step][0], rel_tol=RTOL), (
                f"{nproc} ranks, step {step}: loss {loss} vs {base[step][0]} uninterrupted"
            )
        previous = saved
