"""A 2-rank ZeRO-2 DeepSpeed job under torchrun, told to go at a random moment by its own signals
or the stop file, with no agent: SIGTERM and SIGINT to the launcher's whole process group (what a
pod deletion or Ctrl-C delivers), SIGUSR1 and SIGUSR2 to one worker (what DLRover sends on a
membership change), the stop file, and SIGTERM again with a flash checkpointer that has no agent
to persist it. After each, like a kubelet, the test allows GRACE seconds, then SIGKILLs the group.

Every run: the job is gone within the grace period; the step on storage is at least the last
step every rank had completed when the signal was sent; the next run starts from it, and every
loss it logs equals the uninterrupted run's bit for bit; the last run ends with the same
parameters as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from jobrun import free_port
from repo import SUPPORT

from diag.formats.snapshot import read_latest_step

JOB = SUPPORT / "jobs" / "drain_job.py"
GRACE = 30.0  # Kubernetes' default terminationGracePeriodSeconds
STEPS = 400
# (what is sent, to whom, extra job arguments)
STOPS = (
    ("SIGTERM", "group", ()),
    ("SIGUSR1", "rank", ()),
    ("file", "", ()),
    ("SIGINT", "group", ()),
    ("SIGUSR2", "rank", ()),
    ("SIGTERM", "group", ("--flash",)),
)
# A signal to the group, one to a rank, and the flash path: the default tier. SIGINT and SIGUSR2
# take the same paths as SIGTERM and SIGUSR1, and the stop file is honoured and removed in the
# default tier by test_elastic_resume's drains: the long tier runs them here too.
DEFAULT_STOPS = tuple(s for s in STOPS if s[0] not in ("SIGINT", "SIGUSR2", "file"))


def _wait(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class Job:
    def __init__(self, root: Path, run_dir: Path) -> None:
        self.root, self.run_dir = root, run_dir
        self.save = root / "ckpt"
        self.stop_file = root / "stop"

    def start(self, name: str, *args: str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
            str(JOB), "--steps", str(STEPS), "--save-dir", str(self.save),
            "--out", str(self.root / name), "--stop-file", str(self.stop_file), *args,
        ]  # fmt: skip
        env = dict(os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1")
        with open(self.root / f"{name}.log", "wb") as log:
            # Its own process group, like a container's processes.
            return subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-4000:]

    def progress(self, name: str) -> dict[int, list[tuple[int, float]]]:
        out: dict[int, list[tuple[int, float]]] = {}
        for rank in (0, 1):
            path = self.root / name / f"progress-r{rank}.txt"
            lines = path.read_text().splitlines() if path.exists() else []
            out[rank] = [(int(a), float(b)) for a, b in (x.split() for x in lines if " " in x)]
        return out

    def losses(self, name: str) -> dict[int, str]:
        path = self.root / name / "loss.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return {r["step"]: r["loss"] for r in rows}

    def starts(self, name: str) -> list[dict]:
        path = self.root / name / "starts.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _workers(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if any("drain_job.py" in a for a in k.cmdline())]


@pytest.fixture
def job():
    root = Path(tempfile.mkdtemp(prefix="diag-test-drain-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-drain-run-", dir="/dev/shm"))
    try:
        yield Job(root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_stopped_at_random_moments_by_own_signals_and_stop_file(job: Job, long_tier: bool) -> None:
    seed = int(os.environ.get("DIAG_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    why = f"(seed {seed}: rerun with DIAG_TEST_SEED={seed})"

    base = job.start("base", "--no-drain")
    assert base.wait(600) == 0, job.log("base")
    base_losses = job.losses("base")
    assert sorted(base_losses) == list(range(1, STEPS + 1))

    committed = 0
    for i, (what, whom, extra) in enumerate(STOPS if long_tier else DEFAULT_STOPS):
        name = f"run{i}-{what}"
        proc = job.start(name, "--step-sleep", "0.05", *extra)
        try:
            # Wait until this run has trained a step of its own, then a random moment more.
            assert _wait(lambda n=name: all(job.progress(n).values()), 180), job.log(name)
            time.sleep(rng.uniform(0.0, 1.5))
            sent = time.monotonic()
            if what == "file":
                job.stop_file.touch()
            elif whom == "group":
                os.killpg(proc.pid, signal.Signals[what])
            else:
                workers = _workers(proc)
                assert len(workers) == 2, job.log(name)
                rng.choice(workers).send_signal(signal.Signals[what])
            try:
                rc = proc.wait(GRACE)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: still running {GRACE} s after {what} {why}\n{job.log(name)}")
            gone = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                _kill_group(proc)
        assert rc != 0, f"{name}: a drained job must not report success\n{job.log(name)}"
        assert not _workers(proc)
        progress = job.progress(name)
        # The last step each rank had completed when the signal went out; the slowest one's.
        done = min(
            max((s for s, t in rows if t < sent), default=committed) for rows in progress.values()
        )
        latest = read_latest_step(job.save)
        assert latest is not None and latest >= done, (
            f"{name}: storage holds step {latest}, the ranks had completed {done} when {what} "
            f"came {why}\n{job.log(name)}"
        )
        assert latest < STEPS, f"{name}: the run ended before the signal {why}"
        assert job.starts(name)[0]["step"] == committed, "it resumed from the committed step"
        if whom == "rank" or what == "file":
            assert "exitcode  : 143" in job.log(name), job.log(name)
        if what == "file":
            assert not job.stop_file.exists(), "the stop file is removed once honoured"
        # Every step it logged continues the uninterrupted run exactly.
        got = job.losses(name)
        assert sorted(got) == list(range(committed + 1, min(got, default=committed) + len(got)))
        for step, loss in got.items():
            assert loss == base_losses[step], f"{name}: loss of step {step} differs {why}"
        print(f"{name}: {what} at step >= {done}, committed {latest}, gone in {gone:.2f} s")
        committed = latest

    last = job.start("last")
    assert last.wait(600) == 0, job.log("last")
    assert job.starts("last")[0]["step"] == committed
    got = job.losses("last")
    assert sorted(got) == list(range(committed + 1, STEPS + 1))
    assert all(got[s] == base_losses[s] for s in got)
    pa = torch.load(job.root / "base" / "params.pt")
    pb = torch.load(job.root / "last" / "params.pt")
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), f"parameter {k} differs from the uninterrupted run"
