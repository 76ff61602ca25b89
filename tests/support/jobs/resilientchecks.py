"""What a run of tests/support/jobs/resilient_job.py must leave after its recoveries: each step's
loss once and matching the uninterrupted run, each rank's attempts resumed from memory, and
nothing held past the recoveries (the CPU and GPU tests of in-place recovery)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RSS_NOISE = 32 << 20  # allocator noise a recovery may leave; a leaked engine is far more
HELD = ("threads", "os_threads", "fds", "sockets", "shm_maps", "run_dir_entries")
SLACK = 1  # one more than after the first recovery: a connection still closing, not a leak


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def check_stage(out: Path, hangs: list[int], steps: int) -> dict[int, list[dict]]:
    """The stage's losses, restores and results as a recovery must leave them; returns each
    rank's attempts."""
    ref = {d["step"]: float.fromhex(d["loss"]) for d in lines(out / "reference.jsonl")}
    got = lines(out / "loss.jsonl")
    assert [d["step"] for d in got] == list(range(1, steps + 1)), got  # each step once
    for d in got:  # bit for bit in practice; the bound is the issue's
        assert abs(float.fromhex(d["loss"]) - ref[d["step"]]) <= 1e-5, (out.name, d, ref[d["step"]])
    assert {d["gen"] for d in got if d["step"] > hangs[-1]} == {len(hangs)}
    attempts = {}
    for rank in (0, 1):
        result = json.loads((out / f"result-{rank}.json").read_text())
        assert result["recoveries"] == len(hangs) == result["generation"], result
        a = lines(out / f"attempts-{rank}.jsonl")
        assert [x["start"] for x in a] == [0, *hangs], a
        assert all(x["loaded_from"] == "memory" for x in a[1:]), a
        assert all(x["fault"] for x in a[1:]), a
        attempts[rank] = a
    assert json.loads((out / "result-1.json").read_text())["hung"] == hangs
    return attempts


def check_no_leaks(attempts: dict[int, list[dict]], base: int = 2) -> dict[str, float]:
    """From attempt `base` on, no later attempt holds more than it held (a leak of one per
    recovery shows by the second after it); returns the RSS growth, recorded. Before it: the
    launch has not yet started the lazy threads of a save, and at ZeRO 3 a rank whose forward
    or backward pass a fault interrupted keeps up to two earlier generations' engines (bounded:
    the same two, however many recoveries follow; what holds them is not found yet)."""
    growth = {}
    for rank, a in attempts.items():
        first, last = a[base], a[-1]
        for key in HELD:
            held = [x[key] for x in a[base:]]
            assert max(held) <= first[key] + SLACK, (rank, key, held, a[-1]["thread_names"])
        growth[f"rank {rank} rss growth over {len(a) - 1 - base} recoveries (MiB)"] = round(
            (last["rss"] - first["rss"]) / 2**20, 2
        )
        assert last["rss"] - first["rss"] < RSS_NOISE, (rank, a)
    return growth


def recover_at_the_agents_verdict(run: Any, launch_timeout: float) -> tuple[dict, str]:
    """The job at ZeRO 2 (attached), rank 1 hung after step 5, its collectives' timeout 120 s:
    what ends the hang is `diag agent --on-hang recover` (hang limit 4 s), started here. `run`
    launches the job (`launch`, `stage`, `log`, `root`, `run_dir`: the CPU and GPU tests' runs).
    Checks the outcome; returns each rank's attempts and the agent's log."""
    import os
    import sys

    import jobrun

    steps, hangs = 10, [5]
    agent = jobrun.start(
        [
            sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run.run_dir),
            "--timeline", str(run.root / "timeline"), "--hang-timeout", "4", "--hang-floor", "4",
            "--warmup-timeout", "8", "--on-hang", "recover", "--until", "job-end",
            "--interval", "0.25", "--stop-grace", "5", "--native-stacks", "false",
        ],
        run.root / "agent.log",
        dict(os.environ, DIAG_RUN_DIR=str(run.run_dir)),
    )  # fmt: skip
    try:
        rc = run.launch(
            "--zero", "2", "--steps", str(steps), "--hang-steps", "5", "--attach",
            "--timeout", "120", timeout=launch_timeout,
        )  # fmt: skip
        agent_rc = jobrun.finish(agent, 60)
    finally:
        jobrun.stop(agent)
    agent_log = (run.root / "agent.log").read_text(errors="replace")
    assert rc == 0, run.log() + agent_log[-3000:]
    assert agent_rc == 3, agent_log[-3000:]  # an incident, handled
    attempts = check_stage(run.stage(2), hangs, steps)
    for rank in (0, 1):
        fault = attempts[rank][1]["fault"]
        assert "the agent's verdict: hang: rank 1 is the likely culprit" in fault, fault
    assert "recover in place: 2 of 2 ranks took it" in agent_log, agent_log[-3000:]
    return attempts, agent_log
