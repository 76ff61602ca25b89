"""The collector and the agent work the same under torchrun, the deepspeed launcher and dlrover-run:
each one starts a 2-rank job with a hung rank, and the agent names it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobrun import free_port
from repo import SUPPORT

from diag.cli.demo import DemoSettings, run_demo
from diag.formats.journalmeta import read_meta

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def _launchers() -> dict[str, tuple[str, ...]]:
    py = sys.executable
    return {
        "torchrun": (),
        "deepspeed": (
            py,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
        ),
        "dlrover-run": (
            py,
            str(SUPPORT / "jobs" / "launchers" / "dlrover_run.py"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
        ),
    }


# The default tier runs torchrun and dlrover-run; DeepSpeed's launcher is the long tier (the same
# collector and agent code see its ranks: only who spawns them differs).
LAUNCHERS = ["torchrun", pytest.param("deepspeed", marks=pytest.mark.long), "dlrover-run"]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_hang_is_named_under_each_launcher(name: str, tmp_path: Path) -> None:
    if name == "dlrover-run":
        pytest.importorskip("dlrover", reason="dlrover is installed by scripts/bootstrap.sh")
    opts = DemoSettings(
        nproc=2,
        fault="hang",
        fault_rank=1,
        fault_step=3,
        steps=12,
        workdir=tmp_path,
        merge=False,
        timeout=150,
        launcher=_launchers()[name],
    )
    result = run_demo(opts, out=open(tmp_path / "demo.out", "w"))  # noqa: SIM115
    assert result.verdict is not None, (tmp_path / "agent.log").read_text()[-2000:]
    assert result.verdict["culprit"] == 1 and result.verdict["kind"] == "hang"
    metas = sorted(
        (read_meta(p) for p in (tmp_path / "run").glob("*.journal")), key=lambda m: m.rank
    )
    assert [(m.rank, m.local_rank, m.world_size, m.local_world_size) for m in metas] == [
        (0, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    assert {m.launcher for m in metas} == {name}


# -- a drained worker is restarted, not reported as a success ------------------------------------

DRAIN_JOB = SUPPORT / "jobs" / "drain_job.py"


def _drain_command(name: str, tmp_path: Path) -> list[str]:
    py = sys.executable
    job = [str(DRAIN_JOB), "--steps", "150", "--step-sleep", "0.05", "--save-dir",
           str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--stop-file",
           str(tmp_path / "stop")]  # fmt: skip
    port = str(free_port())
    return {
        # Static rendezvous keeps the first attempt's gloo addresses in torchrun's store, and the
        # restarted ranks then connect to ports nobody listens on (torch 2.13, gloo): restarts
        # need the c10d rendezvous with a store per attempt (_run_until_stopped sets that).
        "torchrun": [py, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--max-restarts", "1"],
        "deepspeed": [py, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                      "--master_port", port],
        "dlrover-run": [py, str(SUPPORT / "jobs" / "launchers" / "dlrover_run.py"), "--standalone",
                        "--nproc_per_node", "2", "--max-restarts", "1"],
    }[name] + job  # fmt: skip


def _run_until_stopped(cmd: list[str], tmp_path: Path, log: str, stop: bool) -> int:
    import os
    import subprocess
    import time

    env = dict(
        os.environ, DIAG_RUN_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )  # fmt: skip
    progress = tmp_path / "out" / "progress-r1.txt"
    with open(tmp_path / log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        if stop:
            deadline = time.monotonic() + 150
            while not (progress.exists() and progress.stat().st_size) and proc.poll() is None:
                assert time.monotonic() < deadline, (tmp_path / log).read_text()[-3000:]
                time.sleep(0.2)
            time.sleep(1.0)
            (tmp_path / "stop").touch()
        return proc.wait(170)
    finally:
        if proc.poll() is None:
            from diag.agent.observe.procs import stop_tree

            stop_tree(proc.pid, grace=5)
            proc.wait(10)


# dlrover-run's restart of drained workers: the long tier (its hang test above runs in the
# default tier, the drain's restart under torchrun below).
DRAIN_LAUNCHERS = [
    "torchrun",
    *(pytest.param(n, marks=pytest.mark.long) for n in ("deepspeed", "dlrover-run")),
]


@pytest.mark.parametrize("name", DRAIN_LAUNCHERS)
def test_a_drained_worker_is_restarted_not_reported_as_success(name: str, tmp_path: Path) -> None:
    """The stop file makes both workers save and leave with exit code 143. torchrun and
    dlrover-run (--max-restarts 1) restart them, and the new workers resume from the saved step
    and finish; the deepspeed launcher, which restarts nothing, exits with 143 (not 0), so the
    pod's restart policy or the job's controller restarts it."""
    import json

    from diag.formats.snapshot import read_latest_step

    if name == "dlrover-run":
        pytest.importorskip("dlrover", reason="dlrover is installed by scripts/bootstrap.sh")
    cmd = _drain_command(name, tmp_path)
    rc = _run_until_stopped(cmd, tmp_path, "first.log", stop=True)
    text = (tmp_path / "first.log").read_text(errors="replace")
    saved = read_latest_step(tmp_path / "ckpt")
    assert saved is not None and 0 < saved < 150, text[-3000:]
    assert not (tmp_path / "stop").exists()
    if name == "deepspeed":
        assert rc == 143, text[-3000:]
        # What the pod's restart does: the same command again.
        rc = _run_until_stopped(cmd, tmp_path, "second.log", stop=False)
        text = (tmp_path / "second.log").read_text(errors="replace")
    assert rc == 0, text[-3000:]
    starts = [json.loads(x) for x in (tmp_path / "out" / "starts.jsonl").read_text().splitlines()]
    assert [s["step"] for s in starts] == [0, saved], text[-3000:]
    if name != "deepspeed":
        assert [s["attempt"] for s in starts] == [0, 1], "restarted by the launcher"
    assert (tmp_path / "out" / "params.pt").exists(), "the restarted workers finished"
