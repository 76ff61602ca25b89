"""The holder of the node's replica in the kill suite (killsuite.py, with replicas): the step it
holds whole, and the `holder` target: its agent SIGKILLed at an instant of taking a push (the
`receive` phase of faults.py), and started again on its replica directory (the agent died, not
its node: its memory stays).

Checked: the holder held a whole replica of the node at the kill (the previous one, or the new
one when the kill came after its rename); the restarted holder removes what the dead one left half
received and takes the node's next pushes. The node kill that comes next restores from whatever
the holder then holds whole (the suite's own checks)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from killchecks import KillResult, memory_step, memory_steps, wait_for
from killprocs import NODE

from diag.formats.snapshot import read_latest_step

if TYPE_CHECKING:
    from killsuite import KillSuite


def replica_step(holder_run: Path) -> int | None:
    """The step of the node's replica the holder holds complete, or None."""
    steps = [
        int(p.name.split("-")[-2])
        for p in (holder_run / ".replicas").glob(f"{NODE}-*-*")
        if (p / "replica.json").exists()
    ]
    return max(steps, default=None)


def settled_replica_step(holder_run: Path, problems: list[str]) -> int | None:
    """The replica step once the holder has finished or dropped a push the kill cut: the parts
    already in its socket may still complete it, or the cut removes the staging."""
    arriving = lambda: list((holder_run / ".replicas").glob(f".in-{NODE}-*"))  # noqa: E731
    if not wait_for(lambda: not arriving(), 60):
        problems.append(f"the holder kept a half-received replica: {arriving()}")
    return replica_step(holder_run)


def kill_holder(suite: KillSuite, phase: str, mode: str, fraction: float) -> KillResult:
    t0 = time.monotonic()
    holder = suite.holder
    assert holder is not None, "a holder kill needs replicas=True"
    fired = suite.fire(phase, [holder.pid], mode, fraction)
    result = KillResult(
        suite.zero, "holder", phase, fired.phase, fired.mode,
        latest_at_kill=read_latest_step(suite.save_dir),
        memory_at_kill=memory_step(memory_steps(suite.run_dir, suite.job)),
        trained_at_kill=max(suite.gen_steps(suite.gen - 1), default=0),
        fired_step=fired.step, fired_tick=fired.tick,
    )  # fmt: skip
    try:
        holder.wait(30)
    except subprocess.TimeoutExpired:
        result.problems.append(f"the holder (pid {holder.pid}) outlived its SIGKILL")
    result.replica_at_kill = suite.replica_step()  # whole on disk: parts checked, manifest last
    left = set(suite.holder_run.joinpath(".replicas").glob(".in-*"))  # what the kill cut
    if result.replica_at_kill is None:
        result.problems.append("the holder's kill left no whole replica of the node")
    suite.holder = suite.procs.holder()
    # The node asks its holder what it holds every few rounds: the restarted one is sent the
    # node's newest step again, newer than the push the kill cut.
    if not wait_for(lambda: (suite.replica_step() or 0) > fired.step, 120):
        result.problems.append(
            f"the restarted holder took no replica newer than step {fired.step} in 120 s"
        )
    result.replica_after = suite.replica_step()
    if kept := sorted(p.name for p in left if p.exists()):
        result.problems.append(f"the restarted holder kept what the dead one half received: {kept}")
    result.problems += suite.watch.take_problems()
    result.seconds = time.monotonic() - t0
    suite.results.append(result)
    return result
