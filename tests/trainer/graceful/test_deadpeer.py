"""A rank that cannot drain leaves promptly when told to go (diag.trainer.graceful.abandon and
its adapter, diag.trainer.graceful.stuckwatch): the rule on its own, then real 3-rank DeepSpeed
jobs (gloo, CPU, flash checkpointer) with one rank killed or frozen."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobrun import free_port
from polling import catches_sigterm, wait_for
from repo import SUPPORT

from diag.trainer.graceful.abandon import AbandonPolicy, Action, DrainProgress, Phase, decide
from diag.trainer.graceful.stopflag import DRAIN_EXIT_CODE

JOB = SUPPORT / "jobs" / "drain_job.py"
RANKS = 2
VICTIM = 1

# -- the rule -------------------------------------------------------------------------------------

POLICY = AbandonPolicy(min_grace_s=5.0, step_factor=3.0)


def _progress(**kw: object) -> DrainProgress:
    base: dict[str, object] = dict(
        requested_at=100.0, phase=Phase.TRAINING, step_s=0.5, unhandled_since=100.0
    )
    base.update(kw)
    return DrainProgress(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("progress", "now", "action"),
    [
        # No request: nothing to decide.
        (_progress(requested_at=None, unhandled_since=None), 1000.0, Action.WAIT),
        # A peer is gone (the agreement raised), or the process is leaving: at once.
        (_progress(agreement_failed=True, unhandled_since=None), 100.0, Action.LEAVE_NOW),
        (_progress(phase=Phase.LEAVING, unhandled_since=None), 100.0, Action.LEAVE_NOW),
        # The drain saves (a save may be long) or is done: wait.
        (_progress(phase=Phase.SAVING), 1000.0, Action.WAIT),
        (_progress(phase=Phase.DONE, agreement_failed=True), 1000.0, Action.WAIT),
        # Training, the handler run: a step however long (the agent and launcher bound it).
        (_progress(unhandled_since=None), 1000.0, Action.WAIT),
        # Training, the handler not run: blocked in C; the grace is max(5 s, 3 x longest step).
        (_progress(), 104.9, Action.WAIT),
        (_progress(), 105.0, Action.LEAVE_NOW),
        (_progress(step_s=4.0), 111.9, Action.WAIT),
        (_progress(step_s=4.0), 112.0, Action.LEAVE_NOW),
        # No step timed yet: a slow first step cannot be told from a stuck one.
        (_progress(step_s=None), 1000.0, Action.WAIT),
    ],
)
def test_the_rule(progress: DrainProgress, now: float, action: Action) -> None:
    assert decide(progress, now, POLICY).action is action


def test_a_waiting_verdict_says_when_to_look_again() -> None:
    assert decide(_progress(), 102.0, POLICY).recheck_s == pytest.approx(1.0)
    assert decide(_progress(), 104.5, POLICY).recheck_s == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs", [{"min_grace_s": 0.0}, {"step_factor": 0.5}])
def test_bad_policy(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="min_grace_s"):
        AbandonPolicy(**kwargs)


# -- real jobs ------------------------------------------------------------------------------------


class Ranks:
    """RANKS processes of the drain job started here, without a launcher, so that the test alone
    decides which signal each gets and reads each one's exit status."""

    def __init__(self, root: Path, run_dir: Path, *args: str) -> None:
        self.root = root
        self.out = root / "out"
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        for rank in range(RANKS):
            env = dict(
                os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS),
            )  # fmt: skip
            cmd = [
                sys.executable, str(JOB), "--flash", "--steps", "100000", "--step-sleep", "0.05",
                "--save-dir", str(root / "ckpt"), "--out", str(self.out), *args,
            ]  # fmt: skip
            with open(root / f"r{rank}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                )

    @property
    def survivors(self) -> list[int]:
        return [r for r in range(RANKS) if r != VICTIM]

    def steps(self, rank: int) -> int:
        path = self.out / f"progress-r{rank}.txt"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def log(self, rank: int) -> str:
        return (self.root / f"r{rank}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.log(r)[-3000:]}" for r in range(RANKS))

    def blocked(self, ranks: list[int], quiet_s: float = 3.0) -> bool:
        """No step done for `quiet_s` (steps take a fraction of a second): in a collective."""
        now = time.monotonic()
        for r in ranks:
            lines = (self.out / f"progress-r{r}.txt").read_text().splitlines()
            if not lines or now - float(lines[-1].split()[1]) < quiet_s:
                return False
        return True

    def training(self) -> bool:
        # A few steps timed on every rank (the rule needs a step time), handlers installed.
        return all(self.steps(r) >= 5 and catches_sigterm(self.procs[r].pid) for r in range(RANKS))

    def gone(self, ranks: list[int]) -> bool:
        return all(self.procs[r].poll() is not None for r in ranks)

    def signal(self, ranks: list[int], sig: signal.Signals) -> None:
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                self.procs[r].send_signal(sig)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


@pytest.fixture
def ranks_dirs() -> Iterator[tuple[Path, Path]]:
    root = Path(tempfile.mkdtemp(prefix="diag-test-deadpeer-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-deadpeer-run-", dir="/dev/shm"))
    try:
        yield root, run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _job(dirs: tuple[Path, Path], *args: str) -> Iterator[Ranks]:
    job = Ranks(*dirs, *args)
    try:
        assert wait_for(job.training, timeout=240), job.logs()
        yield job
    finally:
        job.close()


# Far more than the rule's grace (5 s, or 3 steps of 0.05-0.2 s), far less than what the ranks
# would otherwise wait: gloo's collective timeout (30 min) or the 120 s the job lingers at exit.
BOUND_S = 60.0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_rank_stuck_in_a_collective_with_a_hung_peer_leaves_when_told(
    ranks_dirs: tuple[Path, Path],
) -> None:
    with _job(ranks_dirs) as job:
        job.signal([VICTIM], signal.SIGSTOP)  # hung: its sockets stay open, nothing comes
        # Blocked in the next collective before the signal comes: the Python handler cannot run
        # (one that ran before the rank blocked is the agent's or the launcher's to deal with).
        assert wait_for(lambda: job.blocked(job.survivors), timeout=BOUND_S), job.logs()
        job.signal(job.survivors, signal.SIGTERM)
        assert wait_for(lambda: job.gone(job.survivors), timeout=BOUND_S), job.logs()
        for r in job.survivors:
            assert job.procs[r].returncode == DRAIN_EXIT_CODE, job.logs()
            assert "stuck in a collective that will not complete" in job.log(r), job.log(r)


def _kill_the_victim_then_stop_the_others_as_they_leave(job: Ranks) -> None:
    job.signal([VICTIM], signal.SIGKILL)
    leaving = [job.out / f"leaving-r{r}" for r in job.survivors]
    assert wait_for(lambda: all(p.exists() for p in leaving), timeout=BOUND_S), job.logs()
    job.signal(job.survivors, signal.SIGTERM)
    assert wait_for(lambda: job.gone(job.survivors), timeout=BOUND_S), job.logs()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_stop_that_comes_while_a_rank_leaves_after_a_dead_peer_ends_it(
    ranks_dirs: tuple[Path, Path],
) -> None:
    # The victim's death makes the survivors' next collective raise; the traceback ends the
    # loop and the exit handlers run. A SIGTERM that came before graceful_exit's handler (the
    # lingering handler runs before it and waits for the request) makes them leave right after
    # the exit handlers, with the drain's code, without finalizing the interpreter.
    with _job(ranks_dirs, "--linger-at-exit", "after") as job:
        _kill_the_victim_then_stop_the_others_as_they_leave(job)
        for r in job.survivors:
            assert job.procs[r].returncode == DRAIN_EXIT_CODE, job.logs()
            assert "the stop came while the process was leaving" in job.log(r), job.log(r)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_stop_after_the_drain_is_over_has_its_usual_effect(
    ranks_dirs: tuple[Path, Path],
) -> None:
    # Once graceful_exit's exit handler ran (the lingering one runs after it), nothing can be
    # drained any more: a SIGTERM ends the process at once, as it would without diag.
    with _job(ranks_dirs, "--linger-at-exit", "before") as job:
        _kill_the_victim_then_stop_the_others_as_they_leave(job)
        for r in job.survivors:
            assert job.procs[r].returncode == -signal.SIGTERM, job.logs()
