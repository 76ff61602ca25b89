"""End to end: a real CPU DeepSpeed job under torchrun, a real `diag agent` process, real faults.

Each case runs the demo's job (ZeRO-2, gloo) with one injected fault and checks the verdict, the
incident directory and the stacks py-spy took of the really stuck processes. The false-positive
cases (a straggler, an eval phase longer than the limit, a slow first step) must raise nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diag.cli.demo import DemoResult, DemoSettings, run_demo
from diag.formats.stackdump import RankDump

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NPROC = 3


def _run(tmp_path: Path, fault: str, rank: int = 1, **kw) -> DemoResult:
    opts = DemoSettings(
        nproc=NPROC,
        fault=fault,
        fault_rank=rank,
        fault_step=4,
        steps=kw.pop("steps", 16),
        workdir=tmp_path,
        merge=False,
        timeout=200,
        **kw,
    )
    return run_demo(opts, out=open(tmp_path / "demo.out", "w"))


def _dumps(incident: Path) -> dict[int, RankDump]:
    return {d.rank: d for d in map(RankDump.load, incident.glob("*.stack.json"))}


def _funcs(dump: RankDump) -> list[str]:
    return [f.func for t in dump.threads for f in t.frames]


def _logs(result: DemoResult) -> str:
    return (result.workdir / "agent.log").read_text()[-3000:]


def test_hung_rank_is_named_with_stacks_of_every_rank(tmp_path: Path) -> None:
    # A native dump on a loaded 2-core machine can load symbols for longer than the 10 s default.
    # Under the demo's 3 s floor both limits would be the floor: steps of a wider model (about
    # 0.4 s here) and a floor of 0.2 s put the usual limit (5 x the pace) above the idle rule's (2 x).
    result = _run(
        tmp_path,
        "hang",
        rank=2,
        agent_args=("--pyspy-timeout", "60", "--hang-floor", "0.2"),
        job_args=("--hidden", "1024"),
    )
    assert len(result.incidents) == 1, _logs(result)
    v, incident = result.verdict, result.incidents[0]
    assert v["kind"] == "hang" and v["culprit"] == 2, v
    assert v["suspects"][0]["kind"] == "behind"
    assert sorted(v["waits"][0]["waiting_ranks"]) == [0, 1]
    assert v["limit_expired_s_before_verdict"] < 1.0
    # Rank 2 sleeps in Python: idle, so its waiters are held to the idle rule's shorter limit.
    assert {o["rank"] for o in v["overdue"]} <= {0, 1} and v["overdue"], v["overdue"]
    assert all(o["idle_ranks"] == [2] for o in v["overdue"]), v["overdue"]
    assert "rank 2 idle (no CPU, no I/O)" in v["overdue"][0]["limit_basis"], v["overdue"]
    dumps = _dumps(incident)
    assert sorted(dumps) == [0, 1, 2]
    assert "inject" in _funcs(dumps[2]) and "time_sleep" in _funcs(dumps[2])
    assert all(d.native and not d.error for d in dumps.values()), v.get("evidence")
    # The victims wait inside DeepSpeed's collective, seen in their Python stacks.
    assert any("backward" in f or "step" in f or "reduce" in f for f in _funcs(dumps[0]))
    tails = sorted(p.name for p in incident.glob("*.journal.json"))
    assert tails == [f"0000{r}-0000{NPROC}.journal.json" for r in range(NPROC)]
    tail = json.loads((incident / "00000-00003.journal.json").read_text())
    assert tail["records"][-1]["state"] == "enqueued"  # the collective it is stuck in
    machine = json.loads((incident / "machine.json").read_text())
    assert {p["rank"] for p in machine["processes"]} == {0, 1, 2}
    assert result.job_rc != 0  # the agent stopped the ranks (on_hang=stop)


def test_gil_holding_rank_is_named_and_seen_spinning(tmp_path: Path) -> None:
    result = _run(tmp_path, "gil", rank=1)
    assert len(result.incidents) == 1, _logs(result)
    v = result.verdict
    assert v["culprit"] == 1 and "busy on CPU" in v["suspects"][0]["reason"], v
    dump = _dumps(result.incidents[0])[1]
    main = next(t for t in dump.threads if t.name == "MainThread")
    assert main.owns_gil and main.active
    assert "inject" in [f.func for f in main.frames]


def test_dead_rank_is_named_first(tmp_path: Path) -> None:
    result = _run(tmp_path, "exit", rank=1)
    assert len(result.incidents) == 1, _logs(result)
    v = result.verdict
    assert v["kind"] == "rank_exited" and v["culprit"] == 1, v
    assert v["suspects"][0]["kind"] == "died"


def test_straggler_is_no_incident_but_is_named(tmp_path: Path) -> None:
    result = _run(tmp_path, "straggler", rank=2, steps=30, straggle=0.25)
    assert result.incidents == [], result.verdict
    assert result.job_rc == 0 and result.agent_rc == 0
    top = [s for s in result.stragglers if s.is_straggler]
    assert [s.rank for s in top] == [2]


def test_eval_phase_longer_than_the_limit_is_no_incident(tmp_path: Path) -> None:
    # Rank 0 evaluates for 8 s while the others wait at a barrier, twice; the hang ceiling is
    # 5 s. The waiters inherit rank 0's phase limit.
    result = _run(
        tmp_path,
        "none",
        steps=12,
        hang_timeout=5.0,
        hang_floor=2.0,
        job_args=("--eval-every", "5", "--eval-seconds", "8"),
    )
    assert result.incidents == [], result.verdict
    assert result.job_rc == 0


def test_slow_first_step_is_no_incident(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        "none",
        steps=8,
        hang_timeout=5.0,
        hang_floor=2.0,
        job_args=("--first-step-delay", "9"),
    )
    assert result.incidents == [], result.verdict
    assert result.job_rc == 0
