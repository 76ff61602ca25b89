"""Every kind of fault of the goodput bench in one job: two "nodes" (a launcher, a `diag agent`
and a run directory each), one rank per node, a small model, and a rank killed, a rank hung in
Python, a rank spinning in C with the GIL held, node-b preempted and node-b lost; under the diag
stack (torchrun's restarts) and the in-place one (diag launch, the training under `resilient`,
the agent's verdict recovering in place). The job recovers from each and finishes, resuming each
time from the newest step that was complete: in memory for the faults of a rank and the preemption (whose drain may save one step
more); for the lost node, whose memory went with it, from the replica node-a's agent held for it
(pulled back by node-b's new agent), unless storage names a newer step."""

from __future__ import annotations

from pathlib import Path

import pytest
from goodputkit import KINDS, GoodputJob, JobSpec, read_events, schedule
from goodputtimes import analyse

# The long tier: five restarts of a two-node job cost minutes of both cores. The default tier
# recovers from each kind apart (docs/contributing.md lists where).
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

STEPS, EVERY = 50, 4


@pytest.mark.parametrize("stack", ["diag", "inplace"])
def test_each_fault_kind_is_recovered_from_the_newest_complete_step(
    tmp_path: Path, stack: str
) -> None:
    faults = schedule(seed=3, steps=STEPS, world=2)
    assert sorted(f.kind for f in faults) == sorted(KINDS)
    spec = JobSpec(
        stack, STEPS, hidden=32, every=EVERY, nproc=1, grace=20.0, wait_saves=True,
        # Short limits: this test is about recovering, not about how long detection takes.
        agent_args=("--hang-floor", "3", "--stop-grace", "3", "--interval", "0.25"),
        timeout=800.0,
    )  # fmt: skip
    lines: list[str] = []
    job = GoodputJob(spec, faults, tmp_path, lines.append)
    try:
        outcome = job.run()
    finally:
        job.close()
    logs = "\n".join(lines[-20:])
    assert outcome.finished, f"{outcome.why}\n{logs}"
    events = read_events(tmp_path)
    times = analyse(
        events, faults, outcome.t0, outcome.wall, 2, tmp_path / "timeline", spec.pg_timeout
    )
    assert sorted(x.fault.kind for x in times.losses) == sorted(KINDS), logs
    for x in times.losses:
        what = f"{x.fault}: trained {x.trained}, saved {x.saved}, restored {x.restored}, {x.how}"
        assert x.restored is not None, f"not recovered: {what}\n{logs}"
        if x.fault.kind in ("kill", "hang", "gil"):
            assert x.restored == x.saved and x.source == "memory", what
            if stack == "inplace":  # the survivor kept its process (a dead one's place a spare's)
                assert "recovered in place" in x.how, what
        elif x.fault.kind == "preempt":
            # (from storage when the drain's step went there only)
            assert x.saved <= x.restored <= x.trained + 1, what
        elif x.fault.kind == "lost":
            # The newest step complete on both nodes once node-b's memory is gone: node-b's
            # replica in node-a's memory (node-a's own ranks hold that step too), unless storage
            # names a newer one.
            what += f", storage {x.latest}, replica held {x.replica}, from {x.source}"
            assert x.replica is not None and x.replica <= x.saved, what
            if x.latest is not None and x.latest > x.replica:
                assert x.restored == x.latest and x.source == "storage", what
            else:
                assert x.restored == x.replica, what
                assert x.source == "node-a memory, node-b replica", what
    done = {e["rank"] for e in events if e["ev"] == "done"}
    assert done == {0, 1}, logs
