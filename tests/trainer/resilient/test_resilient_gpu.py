"""In-place recovery on a GPU: the NCCL path. Two ranks of the 2-rank DeepSpeed job
(tests/support/jobs/resilient_job.py) on CUDA with NCCL process groups; rank 1 hangs in Python
while rank 0 waits in an NCCL collective, its stream held by a kernel that waits for the peer.
Rank 0's watcher aborts its communicators from another thread (all of them in one group call),
which ends the kernel and the wait; every rank keeps its process and CUDA context, the world forms
again under the next generation and training goes on from the step in memory. The losses match an
uninterrupted run of the same processes, and the recoveries leave no thread, file descriptor,
socket or GPU memory behind.

One GPU is enough: NCCL refuses two ranks of one host on one device, so each rank is given a host
of its own (`NCCL_HOSTID`) and the two talk over NCCL's socket transport on the loopback, as two
nodes would over their network. Each rank is the one process of its node (LOCAL_RANK 0: both on
cuda:0), under the node's own torchrun, as on two nodes. Skipped without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jobrun
import pytest
import torch
from repo import SUPPORT, pythonpath
from resilientchecks import check_no_leaks, check_stage, lines, recover_at_the_agents_verdict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

JOB = SUPPORT / "jobs" / "resilient_job.py"
GPU_NOISE = 8 << 20  # the caching allocator's slack after a recovery; an engine leaked is more


@dataclass
class GpuRun:
    root: Path
    run_dir: Path

    def launch(self, *args: str, timeout: float) -> int:
        """Both ranks, each the one process of its node's torchrun (a c10d rendezvous that the
        first hosts, the launchers' store outliving the ranks), on GPU 0; the exit status of the
        first launcher that fails, or 0."""
        port = jobrun.free_port()
        run_id = f"gpu{os.getpid()}x{port}"
        procs = []
        for node in (0, 1):
            env = dict(
                os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1",
                PYTHONPATH=pythonpath(os.environ.get("PYTHONPATH", "")),
                NCCL_HOSTID=f"diag-test-{run_id}-node{node}", NCCL_SOCKET_IFNAME="lo",
                NCCL_IB_DISABLE="1",
            )  # fmt: skip
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                "--max-restarts", "0", "--monitor-interval", "0.1", str(JOB),
                "--save-dir", str(self.root / "ckpt"), "--out", str(self.root / "out"), *args,
            ]  # fmt: skip
            procs.append(jobrun.start(cmd, self.root / f"node{node}.log", env))
        deadline = time.monotonic() + timeout
        rc = 0
        try:
            for p in procs:
                try:
                    code = p.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = 124
                rc = rc or code
        finally:
            for p in procs:
                jobrun.stop(p)
        return rc

    def stage(self, zero: int) -> Path:
        return self.root / "out" / f"z{zero}"

    def log(self) -> str:
        return "".join(
            f"--- node {n}\n" + (self.root / f"node{n}.log").read_text(errors="replace")[-4000:]
            for n in (0, 1)
        )


@pytest.fixture
def gpu_run() -> Iterator[GpuRun]:
    root = Path(tempfile.mkdtemp(prefix="diag-test-resilient-gpu-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-resilient-gpu-run-", dir="/dev/shm"))
    try:
        yield GpuRun(root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _costs(run: GpuRun, zero: int) -> list[float]:
    """Each hang's cost on rank 0's clock: from the hang to the first step trained after it."""
    out = run.stage(zero)
    hung = json.loads((out / "result-1.json").read_text())["hung"]
    steps = lines(out / "loss.jsonl")
    hang_t = json.loads((out / "hang.json").read_text())["t"]  # the last one
    after = [d["t"] for d in steps if d["step"] == hung[-1] + 1]
    return [round(after[-1] - hang_t, 2)] if after else []


@pytest.mark.xfail(
    reason="on an H200 (torch 2.11, NCCL 2.28) this run did not end within 100-150 s, twice, with no "
    "output kept: where it stops is not known yet (the agent's verdict and the goodput bench's "
    "kill and hang recover on NCCL)",
    strict=False,
)
@pytest.mark.timeout(240)
def test_nccl_groups_aborted_from_another_thread_recover_in_place(gpu_run: GpuRun) -> None:
    """Four recoveries in the same processes at ZeRO 2, each begun by
    `resilient.interrupt` on the hung rank (what the agent's verdict calls), with rank 0 blocked
    in an NCCL collective."""
    steps, hangs = 11, [3, 5, 7, 9]
    rc = gpu_run.launch(
        "--zero", "2", "--steps", str(steps), "--hang-steps", ",".join(map(str, hangs)),
        "--hang-modes", "interrupt", "--timeout", "120", timeout=200,
    )  # fmt: skip
    assert rc == 0, gpu_run.log()
    for zero, base in ((2, 2),):
        attempts = check_stage(gpu_run.stage(zero), hangs, steps)
        print(f"zero {zero}:", check_no_leaks(attempts, base))
        for rank, a in attempts.items():
            held = [x["cuda_allocated"] for x in a[base:]]
            assert max(held) <= held[0] + GPU_NOISE, (zero, rank, held)
            print(f"zero {zero} rank {rank}: GPU memory allocated per attempt (MiB)",
                  [round(x["cuda_allocated"] / 2**20, 1) for x in a],
                  "recovery (s)", [round(x["recovery_s"], 2) for x in a[1:]])  # fmt: skip
        print(f"zero {zero}: the last hang to the next step (s)", _costs(gpu_run, zero))
    faults = " ".join(x["fault"] for x in lines(gpu_run.stage(2) / "attempts-0.jsonl"))
    assert "the agent's verdict" in faults, faults


def test_the_agents_verdict_aborts_an_nccl_wait(gpu_run: GpuRun) -> None:
    """`diag agent --on-hang recover` watching both ranks (attached): the NCCL collectives'
    timeout is 120 s, so what ends the wait is the agent's verdict over the control channel."""
    attempts, _ = recover_at_the_agents_verdict(gpu_run, 150)
    print("the hang to the next step (s)", _costs(gpu_run, 2),
          "recovery (s)", [round(a[1]["recovery_s"], 2) for a in attempts.values()])  # fmt: skip
