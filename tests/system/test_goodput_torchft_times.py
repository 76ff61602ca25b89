"""The torchft stack's lost time (tests/support/goodput/torchfttimes.py): lost sample throughput,
stalled plus the share of groups missing, on rows made to a known answer and on the events of a
real run of the bench's torchft stack (kept in tests/support/goodput/torchft_run/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from goodputkit import Fault
from torchfttimes import TorchftLoss, analyse_torchft, commits

RUN = Path(__file__).resolve().parents[1] / "support" / "goodput" / "torchft_run"


def _step(pid: int, node: str, rank: int, step: int, t: float, replicas: int) -> dict:
    return {"ev": "step", "pid": pid, "node": node, "rank": rank, "step": step, "t0": t - 1.0,
            "t": t, "replicas": replicas}  # fmt: skip


def test_a_stall_then_steps_with_a_group_missing_are_weighted_by_the_share_missing() -> None:
    # Two groups of one rank, a step a second. Rank 1 (node-b) is killed at 10.5; node-a's next
    # step waits to 16, it trains alone to step 16 at 21, node-b's new process (started at 12)
    # heals and both commit step 17 at 22.
    ev = [
        {"ev": "start", "pid": 1, "node": "node-a", "t": 0.0},
        {"ev": "start", "pid": 2, "node": "node-b", "t": 0.0},
    ]
    for s in range(1, 11):
        ev += [_step(1, "node-a", 0, s, float(s), 2), _step(2, "node-b", 1, s, float(s), 2)]
    ev.append({"ev": "fault", "pid": 2, "node": "node-b", "rank": 1, "id": 0, "kind": "kill",
               "step": 11, "t": 10.5})  # fmt: skip
    ev.append({"ev": "start", "pid": 3, "node": "node-b", "t": 12.0})
    ev.append(_step(1, "node-a", 0, 11, 16.0, 1))
    for s in range(12, 17):
        ev.append(_step(1, "node-a", 0, s, float(s + 5), 1))
    ev.append({"ev": "ready", "pid": 3, "node": "node-b", "rank": 1, "t": 20.0})
    ev.append({"ev": "restored", "pid": 3, "node": "node-b", "rank": 1, "step": 16, "t": 21.5,
               "source": "peer"})  # fmt: skip
    ev += [_step(1, "node-a", 0, 17, 22.0, 2), _step(3, "node-b", 1, 17, 22.0, 2)]
    fault = Fault(0, "kill", 11, 1)
    times = analyse_torchft(ev, [fault], 0.0, 23.0, 2, Path("/nonexistent"), 60.0, nproc=1)
    (loss,) = times.losses
    assert isinstance(loss, TorchftLoss)
    # The window: step 10's commit (10) to step 17's (22). Commits in it: 11 after 6 s (1 s of a
    # step, 5 s stalled), 12-16 and 17 a second each: 7 s of steps, 5 s stalled; missing: half of
    # steps 11-16, 3 s.
    assert loss.window == pytest.approx(12.0)
    assert loss.stalled == pytest.approx(5.0)
    assert loss.missing == pytest.approx(3.0)
    assert loss.degraded == pytest.approx(6.0)
    assert loss.total == pytest.approx(8.0)
    assert loss.source == "peer"
    # Goodput: the steps alone count half.
    assert times.kept == pytest.approx(11 * 1.0 + 6 * 0.5)


def _real_run() -> tuple[list[dict], list[Fault], dict]:
    events = [json.loads(x) for x in (RUN / "events.jsonl").read_text().splitlines() if x]
    faults = [Fault(**f) for f in json.loads((RUN / "faults.json").read_text())]
    return events, faults, json.loads((RUN / "outcome.json").read_text())


def test_a_real_run_each_fault_recovered_loses_its_stall_and_half_of_its_time_alone() -> None:
    events, faults, outcome = _real_run()
    times = analyse_torchft(
        events, faults, outcome["t0"], outcome["wall"], 4, RUN / "timeline", 60.0
    )  # fmt: skip
    cs = commits(events, 2)
    assert [c.step for c in cs] == sorted({c.step for c in cs}), "one commit per step, in order"
    assert {c.share for c in cs} <= {0.5, 1.0}
    recovered = [x for x in times.losses if isinstance(x, TorchftLoss) and x.restored is not None]
    assert sorted(x.fault.kind for x in recovered) == sorted(f.kind for f in faults)
    # Every fault hit node-b: node-a's group trained through all of them in its first processes.
    assert len([e for e in events if e["ev"] == "start" and e["node"] == "node-a"]) == 2
    for x in recovered:
        assert x.total == pytest.approx(x.stalled + x.missing)
        assert 0.0 <= x.missing <= 0.5 * x.degraded + 1e-9  # one group of two missing at most
        assert x.stalled + x.degraded <= x.window + 1e-6
        # No step was committed between the fault and the healthy group's next commit: that
        # wait, less one usual step, is stalled time at least.
        after = next(c for c in cs if c.t > x.at)
        before = max(c.t for c in cs if c.t <= x.at)
        assert x.stalled >= (after.t - before) - times.step_s * 2 - 1e-6
        assert x.source == "peer"  # its group came back and healed from the other
    assert times.kept < sum(c.t - c.t0 for c in cs)  # steps alone count at their share
