"""diag.trainer.hf: the `graceful_exit` and `deepspeed_elastic` callbacks with a real
`transformers.Trainer` (tiny GPT-2 from a config, DeepSpeed ZeRO-2 on CPU, torchrun), and the stop
flag they build on (diag.trainer.graceful.stopflag)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import jobrun
import pytest
from repo import SUPPORT
from transformers import TrainerControl, TrainerState

from diag.trainer.graceful.stopflag import StopFlag
from diag.trainer.hf import GracefulExitCallback, callbacks_map

JOB = SUPPORT / "jobs" / "hf_job.py"
RTOL = 1e-5  # float32 sums grouped differently at another world size; see test_elastic_resume


def test_signal_sets_the_flag_and_uninstall_restores() -> None:
    flag = StopFlag()
    before = signal.getsignal(signal.SIGUSR2)
    flag.install((signal.SIGUSR2,))
    try:
        assert not flag.is_set()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.requested is not None and flag.requested.reason == "SIGUSR2"
        flag.request("later")  # the first reason stays
        assert flag.requested.reason == "SIGUSR2"
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR2) is before


def test_handlers_only_from_the_main_thread() -> None:
    errors: list[Exception] = []

    def install() -> None:
        try:
            StopFlag().install((signal.SIGUSR2,))
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=install)
    t.start()
    t.join(10)
    assert errors and "main thread" in str(errors[0])


def test_graceful_exit_saves_then_stops_at_the_same_step() -> None:
    flag = StopFlag()
    cb = GracefulExitCallback(flag=flag, signals=(signal.SIGUSR2,))
    try:
        state, control = TrainerState(), TrainerControl()
        state.global_step = 4
        cb.on_step_end(None, state, control)
        assert not control.should_save and not control.should_training_stop
        os.kill(os.getpid(), signal.SIGUSR2)
        state.global_step = 5
        cb.on_step_end(None, state, control)
        assert control.should_save and not control.should_training_stop
        cb.on_save(None, state, control)
        assert control.should_training_stop and cb.stopped_at == 5
        # At the end of train(): the drain exit code, so that the launcher restarts the worker.
        with pytest.raises(SystemExit) as left:
            cb.on_train_end(None, state, control)
        assert left.value.code == 143
    finally:
        flag.uninstall()
    quiet = GracefulExitCallback(flag=StopFlag(), signals=(), exit=False)
    quiet.stopped_at = 5
    assert quiet.on_train_end(None, TrainerState(), TrainerControl()) is not None
    untouched = GracefulExitCallback(flag=StopFlag(), signals=(), exit_code=99)
    assert untouched.on_train_end(None, TrainerState(), TrainerControl()) is not None
    assert set(callbacks_map) == {"graceful_exit", "deepspeed_elastic"}


# -- real processes ----------------------------------------------------------------------------


def _start(tmp: Path, name: str, nproc: int, *args: str) -> subprocess.Popen:
    cmd = jobrun.command(nproc, JOB, "--out", str(tmp / name), *args)
    return jobrun.start(cmd, tmp / f"{name}.log", dict(os.environ, OMP_NUM_THREADS="1"))


def _log(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")[-4000:]


def _progress(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_signal_to_one_rank_saves_all_and_a_restart_at_3_ranks_continues(tmp_path: Path) -> None:
    # 1. Two ranks train with no end in sight; SIGUSR1 (what DLRover sends) reaches rank 1 only.
    job = _start(tmp_path, "a", 2)
    try:
        deadline = time.monotonic() + 240
        progress = None
        while time.monotonic() < deadline and job.poll() is None:
            progress = _progress(tmp_path / "a" / "progress-1")
            if progress and progress["step"] >= 2:
                break
            time.sleep(0.1)
        assert progress and progress["step"] >= 2, _log(tmp_path, "a")
        os.kill(progress["pid"], signal.SIGUSR1)
    finally:
        rc = jobrun.finish(job)
    # The drained workers leave with 143: torchrun (no restarts left here) reports a failure
    # instead of a job that ended.
    assert rc != 0 and "exitcode  : 143" in _log(tmp_path, "a"), _log(tmp_path, "a")
    results = [json.loads((tmp_path / "a" / f"result-{r}.json").read_text()) for r in (0, 1)]
    stopped = results[0]["stopped_at"]
    assert stopped is not None and stopped >= progress["step"]
    assert [r["stopped_at"] for r in results] == [stopped, stopped], "every rank, the same step"
    assert [r["requested"] for r in results] == [None, "SIGUSR1"], "rank 0 stopped on the agreement"
    assert (results[0]["train_batch_size"], results[0]["micro_batch_size"]) == (12, 3)
    ckpt = tmp_path / "a" / "run" / f"checkpoint-{stopped}"
    assert (ckpt / "latest").read_text().strip() == f"global_step{stopped}"

    # 2. Three ranks resume from it: same global batch, other micro batch; DeepSpeed loads it
    #    through its universal checkpoint (converted by diag on rank 0).
    upto = stopped + 3
    rc = jobrun.finish(_start(tmp_path, "b", 3, "--resume", str(ckpt), "--max-steps", str(upto)))
    assert rc == 0, _log(tmp_path, "b")
    b = json.loads((tmp_path / "b" / "result-0.json").read_text())
    assert (b["world_size"], b["global_step"]) == (3, upto)
    assert (b["train_batch_size"], b["micro_batch_size"], b["gradient_accumulation_steps"]) == (
        12, 2, 2,
    )  # fmt: skip
    assert (ckpt / ".diag" / "universal" / f"global_step{stopped}" / "latest_universal").is_file()
    resumed = _losses(tmp_path / "b" / "loss.jsonl")
    assert sorted(resumed) == list(range(stopped + 1, upto + 1))

    # 3. The same steps uninterrupted at two ranks: the resumed losses continue them.
    rc = jobrun.finish(_start(tmp_path, "c", 2, "--max-steps", str(upto)))
    assert rc == 0, _log(tmp_path, "c")
    base = _losses(tmp_path / "c" / "loss.jsonl")
    for step, loss in resumed.items():
        assert math.isclose(loss, base[step], rel_tol=RTOL), (step, loss, base[step])
    assert any(abs(base[s] - base[s - 1]) > 1e-3 for s in resumed), "the losses move"
