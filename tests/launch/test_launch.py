"""diag launch end to end (real processes, a real 2-rank ZeRO-2 DeepSpeed job on gloo, the
flash checkpointer in the node's shared memory): rank 1 is SIGKILLed right after the flash save
of a step. Under `@resilient` the survivor keeps its process, a warm spare (started with the
workers, before the kill) takes rank 1 and restores the dead rank's snapshot from memory, and
the losses after the recovery equal an uninterrupted run's. Without `@resilient` the same kill
gives torchrun's restart of every worker (the fallback), and the job still finishes. Across two
launchers (two nodes of one rank each, on loopback, through the c10d rendezvous) the node that
lost its rank replaces it and the other node's launcher and worker are left alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jobrun
import psutil
import pytest
from repo import SUPPORT

JOB = SUPPORT / "jobs" / "resilient_job.py"
STEPS, KILL = 6, 3
# The launcher's line when a spare took a dead worker's place (workerpolicy.py): warm or not.
SPARE_TOOK = r"a (warm spare|spare still importing torch and DeepSpeed) takes its place"


@dataclass
class Launch:
    root: Path
    run_dir: Path

    def command(self, name: str, launch: list[str], job: list[str]) -> list[str]:
        return [
            # The spare starts with the workers; the kill, seconds later, may find it still
            # importing (then it takes the place all the same, and the launcher says so).
            sys.executable, "-m", "diag.cli.main", "launch", *launch, "--max-restarts", "1",
            "--spare-delay", "0",
            str(JOB), "--zero", "2", "--steps", str(STEPS), "--hang-steps", str(KILL),
            "--hang-modes", "kill", "--save-dir", str(self.root / name / "ckpt"),
            "--out", str(self.root / name / "out"), *job,
        ]  # fmt: skip

    def env(self, run_dir: Path, **extra: str) -> dict[str, str]:
        return dict(os.environ, DIAG_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([str(SUPPORT), str(SUPPORT / "jobs")]),
                    **extra)  # fmt: skip

    def run(self, name: str, *args: str, timeout: float = 240) -> int:
        cmd = self.command(name, ["--standalone", "--nproc-per-node", "2"], list(args))
        return jobrun.run(cmd, self.log(name), self.env(self.run_dir), timeout)

    def out(self, name: str) -> Path:
        return self.root / name / "out" / "z2"

    def log(self, name: str) -> Path:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        return self.root / name / "launch.log"

    def tail(self, name: str) -> str:
        return self.log(name).read_text(errors="replace")[-6000:]


@pytest.fixture
def launch() -> Iterator[Launch]:
    root = Path(tempfile.mkdtemp(prefix="diag-test-launch-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-launch-run-", dir="/dev/shm"))
    try:
        yield Launch(root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _left_behind(run_dir: Path) -> list[int]:
    """Processes of a launch still running (the launch's environment names its run dir)."""
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("DIAG_RUN_DIR") == str(run_dir):
                left.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return left


def _losses(path: Path) -> dict[int, float]:
    return {d["step"]: float.fromhex(d["loss"]) for d in _lines(path)}


def _as_uninterrupted(out: Path) -> None:
    """Every step's loss within 1e-5 of the uninterrupted reference run's."""
    reference = _losses(out / "reference.jsonl")
    got = _lines(out / "loss.jsonl")
    assert sorted({d["step"] for d in got}) == list(range(1, STEPS + 1)), got
    for d in got:
        assert abs(float.fromhex(d["loss"]) - reference[d["step"]]) <= 1e-5, (d, reference)


def _recovering_agent(launch: Launch, timeline: Path) -> subprocess.Popen:
    """`diag agent --on-hang recover` over the launch's run directory, with short limits."""
    return jobrun.start(
        [
            sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(launch.run_dir),
            "--timeline", str(timeline), "--hang-timeout", "4", "--hang-floor", "4",
            "--warmup-timeout", "8", "--on-hang", "recover", "--until", "job-end",
            "--interval", "0.25", "--stop-grace", "3", "--native-stacks", "false",
        ],
        launch.log("agent"),
        launch.env(launch.run_dir),
    )  # fmt: skip


@pytest.mark.slow
def test_a_killed_rank_is_replaced_alone_under_resilient_and_restarts_every_rank_without(
    launch: Launch,
) -> None:
    # Under @resilient: the spare takes rank 1; rank 0 keeps its process. The same processes
    # ran the uninterrupted reference first.
    rc = launch.run("spare", "--timeout", "15")
    assert rc == 0, launch.tail("spare")
    log = launch.tail("spare")
    assert re.search(r"rank 1 was killed by signal 9; " + SPARE_TOOK, log), log
    assert "restarting every worker" not in log, log
    out = launch.out("spare")
    reference = _losses(out / "reference.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1))
    killed = json.loads((out / "hang.json").read_text())
    got = _lines(out / "loss.jsonl")
    assert [d["step"] for d in got] == list(range(1, STEPS + 1)), got  # each step once
    for d in got:  # bit for bit in practice; the bound is the issue's
        assert abs(float.fromhex(d["loss"]) - reference[d["step"]]) <= 1e-5, (d, reference)
    assert {d["gen"] for d in got if d["step"] > KILL} == {1}
    survivor, replaced = _lines(out / "attempts-0.jsonl"), _lines(out / "attempts-1.jsonl")
    assert [a["pid"] for a in survivor] == [survivor[0]["pid"]] * 2, survivor
    assert [a["start"] for a in survivor] == [0, KILL], survivor
    assert "peer_lost" in survivor[1]["fault"] or "posted" in survivor[1]["fault"], survivor
    assert [a["start"] for a in replaced] == [0, KILL], replaced
    spare = replaced[1]
    assert spare["pid"] != replaced[0]["pid"]
    assert spare["started"] < killed["t"], (spare, killed)  # warm: started before the kill
    assert spare["loaded_from"] == "memory" and spare["generation"] == 1, spare
    for rank in (0, 1):
        result = json.loads((out / f"result-{rank}.json").read_text())
        assert (result["generation"], result["recoveries"]) == (1, 1), result
    assert not list(launch.run_dir.iterdir())  # the slots (the dead rank's too) removed
    assert not _left_behind(launch.run_dir)  # the spare started after the take stopped too

    # Without @resilient: torchrun's restart of every worker, and the job finishes.
    rc = launch.run("plain", "--plain", "--no-reference", "--timeout", "15")
    assert rc == 0, launch.tail("plain")
    log = launch.tail("plain")
    assert "restarting every worker: rank 1 was killed by signal 9" in log, log
    assert "takes its place" not in log, log
    plain = launch.out("plain")
    pids = {d["pid"] for d in _lines(plain / "attempts-0.jsonl")}
    assert len(pids) == 2, pids  # rank 0 was restarted too
    got = _lines(plain / "loss.jsonl")
    assert sorted({d["step"] for d in got}) == list(range(1, STEPS + 1)), got
    for d in got:
        assert abs(float.fromhex(d["loss"]) - reference[d["step"]]) <= 1e-5, d
    assert not _left_behind(launch.run_dir)


@pytest.mark.slow
def test_a_rank_stuck_in_c_is_stopped_by_the_agent_and_replaced_by_a_spare(launch: Launch) -> None:
    """The path of a rank that cannot recover in its own process: stuck in C with the GIL held,
    it cannot answer the agent's RECOVER; the agent stops it after --stop-grace, diag launch
    puts a warm spare in its place, and rank 0, which took the RECOVER, trains on with it."""
    agent = _recovering_agent(launch, launch.root / "timeline")
    try:
        rc = launch.run("gil", "--hang-modes", "gil", "--attach", "--timeout", "120")
        jobrun.finish(agent, 60)
    finally:
        jobrun.stop(agent)
    agent_log = launch.log("agent").read_text(errors="replace")
    assert rc == 0, launch.tail("gil") + agent_log[-3000:]
    assert "rank 0: recovering in place from generation 0" in agent_log, agent_log[-3000:]
    assert "rank 1: no answer within the grace" in agent_log, agent_log[-3000:]
    assert re.search(SPARE_TOOK, launch.tail("gil")), launch.tail("gil")
    out = launch.out("gil")
    _as_uninterrupted(out)
    survivor, replaced = _lines(out / "attempts-0.jsonl"), _lines(out / "attempts-1.jsonl")
    assert [a["pid"] for a in survivor] == [survivor[0]["pid"]] * 2, survivor
    assert "the agent's verdict" in survivor[1]["fault"], survivor
    assert replaced[-1]["pid"] != replaced[0]["pid"] and replaced[-1]["loaded_from"] == "memory"
    assert not _left_behind(launch.run_dir)


@pytest.mark.slow
def test_a_hang_after_a_replacement_is_an_incident_of_its_own(launch: Launch) -> None:
    """Rank 1 is killed at step 3 (a spare takes its place in the next world of the same
    attempt), then the spare hangs in Python at step 5: the agent names it in an incident of the
    new world, not as a consequence of the death the world before (which the spare undid)."""
    timeline = launch.root / "timeline"
    agent = _recovering_agent(launch, timeline)
    try:
        rc = launch.run("two", "--hang-modes", "kill+sleep", "--hang-steps", "3,5", "--attach",
                        "--timeout", "120")  # fmt: skip
        jobrun.finish(agent, 60)
    finally:
        jobrun.stop(agent)
    agent_log = launch.log("agent").read_text(errors="replace")
    assert rc == 0, launch.tail("two") + agent_log[-3000:]
    verdicts = {
        d.name: json.loads((d / "verdict.json").read_text())
        for d in timeline.glob("*@*") if (d / "verdict.json").is_file()
    }  # fmt: skip
    died = [v for v in verdicts.values() if v["kind"] == "rank_exited"]
    hung = [v for v in verdicts.values() if v["kind"] == "hang"]
    assert len(died) == 1 and len(hung) == 1, (sorted(verdicts), agent_log[-3000:])
    assert died[0]["incident_id"].endswith("a0-rank_exited"), died[0]
    assert "a0g1-hang-" in hung[0]["incident_id"], hung[0]
    assert (died[0]["culprit"], hung[0]["culprit"]) == (1, 1), (died[0], hung[0])
    assert "part of job incident" not in hung[0]["summary"], hung[0]
    _as_uninterrupted(launch.out("two"))
    assert not _left_behind(launch.run_dir)


@pytest.mark.slow
@pytest.mark.long
def test_a_replacement_on_one_node_leaves_the_other_node_alone(launch: Launch) -> None:
    """Two launchers of one rank each (nodes a and b: their own run directories and node
    names), one c10d rendezvous on loopback; whichever node holds rank 1 loses it. The default
    tier's equivalent is the one-node test above (the same replacement, one launcher)."""
    port = str(jobrun.free_port())
    procs = {}
    for node in ("a", "b"):
        run_dir = launch.run_dir / node
        run_dir.mkdir()
        cmd = launch.command("nodes", [
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
            "--local-addr", "127.0.0.1",
        ], ["--timeout", "15"])  # fmt: skip
        env = launch.env(run_dir, DIAG_NODE=f"node-{node}")
        procs[node] = jobrun.start(cmd, launch.log(f"node-{node}"), env)
    rcs = {node: jobrun.finish(p, 240) for node, p in procs.items()}
    logs = {node: launch.tail(f"node-{node}") for node in procs}
    assert rcs == {"a": 0, "b": 0}, logs
    replaced = [n for n, text in logs.items() if re.search(SPARE_TOOK, text)]
    assert len(replaced) == 1, logs  # the node that held rank 1
    other = "b" if replaced == ["a"] else "a"
    assert "restarting every worker" not in logs[other] + logs[replaced[0]], logs
    out = launch.out("nodes")
    reference = _losses(out / "reference.jsonl")
    got = _lines(out / "loss.jsonl")
    assert [d["step"] for d in got] == list(range(1, STEPS + 1)), got
    for d in got:
        assert abs(float.fromhex(d["loss"]) - reference[d["step"]]) <= 1e-5, (d, reference)
    survivor, spare = _lines(out / "attempts-0.jsonl"), _lines(out / "attempts-1.jsonl")
    assert survivor[0]["pid"] == survivor[1]["pid"], survivor  # node `other` kept its worker
    assert spare[0]["pid"] != spare[1]["pid"] and spare[1]["loaded_from"] == "memory", spare
    assert not _left_behind(launch.run_dir / "a") and not _left_behind(launch.run_dir / "b")
