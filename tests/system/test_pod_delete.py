"""A pod deleted the way the kubelet does it, at a random moment of a 2-rank ZeRO-2 DeepSpeed job
with flash checkpoints in memory and a real `diag agent` beside it:

- classic sidecar: SIGTERM to the launcher's process group and to the agent at the same moment;
- native sidecar: SIGTERM to the launcher's group, and to the agent only once the launcher exited;

each with a trainer that drains on its own signals (`graceful_exit`) and with one that SIGTERM
kills mid-step; then a step far longer than the grace period (the agent persists what it has and
stops the ranks); then an early reclaim notice from a local metadata server (GCE's answers);
then an AWS spot notice two minutes ahead during a long step, and the kubelet's SIGTERM soon after
it (the drain must then keep to the grace period, not to the notice). Like the kubelet, the test
SIGKILLs whatever is left GRACE seconds after SIGTERM.

Every run: the launcher and the agent are gone within the grace period; the step committed on
storage is at least the last step every rank had completed when SIGTERM came; the next "pod"
(a new run directory: nothing in memory) starts from it with parameters equal to the
uninterrupted run's at that step, and every loss it logs equals that run's bit for bit.
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
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from jobrun import free_port
from metadata_server import Metadata, aws_action
from repo import SUPPORT

from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import read_latest_step

JOB_SCRIPT = SUPPORT / "jobs" / "pod_job.py"
JOB = "podjob"
GRACE = 30.0  # Kubernetes' default terminationGracePeriodSeconds, given to the agent too
STEPS = 300


def _wait(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class Pod:
    """One "pod": a run directory in /dev/shm (its memory), the launcher and the agent."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        self.save = root / "ckpt"  # storage: outlives every pod
        self.out = root / name
        self.run_dir = Path(tempfile.mkdtemp(prefix="diag-test-pod-", dir="/dev/shm"))
        self.job: subprocess.Popen | None = None
        self.agent: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return dict(os.environ, DIAG_RUN_DIR=str(self.run_dir), DIAG_JOB=JOB, OMP_NUM_THREADS="1")

    def start_agent(self, *extra: str) -> None:
        cmd = [
            sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(self.run_dir),
            "--job", JOB, "--timeline", str(self.root / "timeline"), "--native-stacks", "false",
            "--interval", "0.25", "--termination-grace", str(GRACE), "-v", *extra,
        ]  # fmt: skip
        with open(self.root / f"{self.name}-agent.log", "wb") as log:
            self.agent = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=log)
        sock = control_socket_path(self.run_dir, JOB)
        assert _wait(sock.exists, 60), self.agent_log()

    def start_job(self, *args: str) -> None:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
            str(JOB_SCRIPT), "--steps", str(STEPS), "--save-dir", str(self.save),
            "--out", str(self.out), *args,
        ]  # fmt: skip
        with open(self.root / f"{self.name}.log", "wb") as log:
            # A process group of its own, like a container's processes.
            self.job = subprocess.Popen(
                cmd, env=self.env(), stdout=log, stderr=log, start_new_session=True
            )

    def progress(self) -> dict[int, list[tuple[int, float]]]:
        out: dict[int, list[tuple[int, float]]] = {}
        for rank in (0, 1):
            path = self.out / f"progress-r{rank}.txt"
            lines = path.read_text().splitlines() if path.exists() else []
            out[rank] = [(int(a), float(b)) for a, b in (x.split() for x in lines if " " in x)]
        return out

    def last_step(self) -> int:
        return min((rows[-1][0] if rows else 0) for rows in self.progress().values())

    def completed_before(self, t: float, floor: int) -> int:
        """The last step every rank had completed (in memory too) before monotonic time t."""
        return min(
            max((s for s, at in rows if at < t), default=floor) for rows in self.progress().values()
        )

    def rows(self, name: str) -> list[dict]:
        path = self.out / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def log(self) -> str:
        text = (self.root / f"{self.name}.log").read_text(errors="replace")
        return text[-3000:] + "\n--- agent ---\n" + self.agent_log()

    def agent_log(self) -> str:
        path = self.root / f"{self.name}-agent.log"
        return path.read_text(errors="replace")[-5000:] if path.exists() else ""

    def kill_all(self) -> None:
        """What the kubelet does at the end of the grace period."""
        if self.job is not None and self.job.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.job.pid, signal.SIGKILL)
            self.job.wait(30)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait(30)

    def close(self) -> None:
        self.kill_all()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _workers(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if any("pod_job.py" in a for a in k.cmdline())]


def _gone_by(proc: subprocess.Popen, deadline: float) -> int | None:
    try:
        return proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(prefix="diag-test-poddel-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# (name, sidecar order, trainer drains on its own signals, extra)
RUNS = (
    ("classic-drain", "classic", True, ""),
    ("native-nodrain", "native", False, ""),
    ("classic-nodrain", "classic", False, ""),
    ("native-drain", "native", True, ""),
    ("classic-longstep", "classic", True, "long"),
    ("notice", "notice", True, ""),
    ("aws-longstep", "aws", True, "long"),
)
# Each sidecar order, with and without a drain, a long step and a notice: the default tier. The
# long tier runs the other pairings and the second notice too.
DEFAULT_RUNS = tuple(r for r in RUNS if r[0] in ("classic-drain", "native-nodrain", "aws-longstep"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pod_deleted_at_random_moments(root: Path, long_tier: bool) -> None:
    seed = int(os.environ.get("DIAG_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    why = f"(seed {seed}: rerun with DIAG_TEST_SEED={seed})"

    base = Pod(root, "base")
    try:
        base.start_agent()
        base.start_job("--digest-every-step")
        assert base.job is not None and base.job.wait(600) == 0, base.log()
    finally:
        base.close()
    base_losses = {r["step"]: r["loss"] for r in base.rows("loss.jsonl")}
    base_digests = {r["step"]: r["digest"] for r in base.rows("digests.jsonl")}
    assert sorted(base_losses) == list(range(1, STEPS + 1))

    committed = 0
    for name, order, drains, extra in RUNS if long_tier else DEFAULT_RUNS:
        pod = Pod(root, name)
        metadata = Metadata() if order in ("notice", "aws") else None
        try:
            committed = _delete_pod(pod, rng, why, order, drains, extra, committed, metadata)
        finally:
            pod.close()
            if metadata is not None:
                metadata.close()
        # The new pod's relaunch (next iteration, or the last run) starts from `committed`.
        _check_run(pod, base_losses, base_digests, why)

    last = Pod(root, "last")
    try:
        last.start_agent()
        last.start_job()
        assert last.job is not None and last.job.wait(600) == 0, last.log()
    finally:
        last.close()
    assert last.rows("starts.jsonl")[0]["step"] == committed
    _check_run(last, base_losses, base_digests, why)
    got = {r["step"] for r in last.rows("loss.jsonl")}
    assert got == set(range(committed + 1, STEPS + 1))


def _delete_pod(
    pod: Pod,
    rng: random.Random,
    why: str,
    order: str,
    drains: bool,
    extra: str,
    committed: int,
    metadata: Metadata | None,
) -> int:
    agent_args = []
    if extra == "long":
        # The ranks are stopped at the rank deadline and their launcher must still exit within
        # the grace: on this shared 2-core machine at load 30+ torchrun took over 5 s to exit
        # after its workers were killed, so this pod keeps more of the grace for that.
        agent_args = ["--drain-margin", "8"]
    if order == "notice":
        assert metadata is not None
        agent_args = ["--preemption-notice", "gce", "--notice-url", metadata.gce_url,
                      "--notice-interval", "0.5"]  # fmt: skip
    if order == "aws":
        assert metadata is not None
        agent_args += ["--preemption-notice", "aws", "--notice-url", metadata.aws_url,
                       "--notice-interval", "0.5"]  # fmt: skip
    pod.start_agent(*agent_args)
    args = ["--step-sleep", "0.05"] + (["--drain"] if drains else [])
    long_step = 0
    if extra == "long":
        long_step = committed + 12
        args += ["--long-step", f"{long_step}:{int(GRACE * 3)}"]
    pod.start_job(*args)
    assert pod.job is not None and pod.agent is not None
    # This pod trained a step of its own; then a random moment (inside the long step).
    first = long_step - 1 if long_step else committed + 1
    assert _wait(lambda: pod.last_step() >= first, 240), pod.log()
    time.sleep(rng.uniform(0.3, 1.5) if long_step else rng.uniform(0.0, 1.5))

    if order == "aws":
        # Two minutes' notice: the agent starts draining (the ranks, in their long step, get
        # EXIT); the node is drained and the pod deleted long before the reclaim.
        assert metadata is not None
        metadata.action, metadata.scheduled = aws_action(120), True
        assert _wait(lambda: "aws reclaim notice" in pod.agent_log(), 30), pod.agent_log()
        time.sleep(rng.uniform(0.5, 3.0))
    sent = time.monotonic()
    if order == "notice":
        assert metadata is not None
        metadata.scheduled = True
    else:
        os.killpg(pod.job.pid, signal.SIGTERM)
        if order in ("classic", "aws"):
            pod.agent.send_signal(signal.SIGTERM)
    deadline = sent + GRACE
    job_rc = _gone_by(pod.job, deadline)
    job_gone = time.monotonic() - sent
    if order == "native" and job_rc is not None:
        pod.agent.send_signal(signal.SIGTERM)  # the trainer container has exited
    if order == "notice":
        # The early drain leaves the agent running, waiting for the SIGTERM that follows.
        assert job_rc is not None and pod.agent.poll() is None, pod.log()
        pod.agent.send_signal(signal.SIGTERM)
    agent_rc = _gone_by(pod.agent, deadline)
    agent_gone = time.monotonic() - sent
    pod.kill_all()
    assert job_rc is not None, f"{pod.name}: the job outlived the grace period {why}\n{pod.log()}"
    assert agent_rc == 0, f"{pod.name}: agent {agent_rc} within the grace {why}\n{pod.log()}"
    assert not _workers(pod.job.pid)
    assert job_rc != 0, f"{pod.name}: a deleted pod's job must not report success\n{pod.log()}"

    done = pod.completed_before(sent, committed)
    latest = read_latest_step(pod.save)
    assert latest is not None and latest >= done, (
        f"{pod.name}: storage holds step {latest}, every rank had completed {done} at "
        f"SIGTERM {why}\n{pod.log()}"
    )
    assert latest < STEPS, f"{pod.name}: the run ended before SIGTERM {why}"
    if long_step:
        assert latest == long_step - 1, "the newest complete snapshot before the long step"
        assert "reached no step boundary" in pod.agent_log()
    if order == "aws":
        assert "during the drain for aws reclaim notice" in pod.agent_log(), pod.agent_log()
    if order == "notice":
        assert "gce reclaim notice: preempted" in pod.agent_log()
        assert "exitcode  : 143" in pod.log(), "drained ranks leave with 143"
    print(
        f"{pod.name}: SIGTERM after step {done}, committed {latest}; job gone in "
        f"{job_gone:.2f} s, agent in {agent_gone:.2f} s"
    )
    return latest


def _check_run(pod: Pod, losses: dict[int, str], digests: dict[int, str], why: str) -> None:
    start = pod.rows("starts.jsonl")[0]
    assert start["from"] in ("storage", ""), "a new pod has nothing in memory"
    if start["step"]:
        assert start["digest"] == digests[start["step"]], (
            f"{pod.name}: the parameters it resumed with differ from the uninterrupted run's "
            f"at step {start['step']} {why}"
        )
    got = {r["step"]: r["loss"] for r in pod.rows("loss.jsonl")}
    for step, loss in got.items():
        assert loss == losses[step], f"{pod.name}: loss of step {step} differs {why}"
    if got:
        assert sorted(got) == list(range(start["step"] + 1, max(got) + 1))
