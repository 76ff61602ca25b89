"""The collector's CUDA-event path under NCCL, watched by a real `diag agent`: a collective held
on the device behind a kernel that spins on a host-mapped flag is seen as enqueued but not
started, the agent files a hang naming the rank with its evidence, and releasing the flag lets
the collective complete. The same hold feeds PyTorch's NCCL flight recorder, whose dump is
checked against the journal; the agent takes it into the incident (the rank's worker server
answers while the training thread waits) and `diag merge` shows it. Skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobrun import command, finish, start, stop
from repo import SUPPORT

from diag.formats.incidentdir import VERDICT_FILE
from diag.formats.journalmeta import JOURNAL_SUFFIX, read_meta
from diag.formats.journalreader import JournalReader
from diag.formats.records import OpCode, OpFlag, OpState, RecordKind
from diag.viewer.merge import merge_incident

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.timeout(240),
]

JOB = "cudahang"
JOB_SCRIPT = SUPPORT / "jobs" / "cuda_hang_job.py"


def _wait(pred, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.1)


def _incidents(timeline: Path) -> list[Path]:
    if not timeline.exists():
        return []
    return sorted(d for d in timeline.iterdir() if (d / VERDICT_FILE).exists())


def _ops(run_dir: Path) -> list:
    (path,) = run_dir.glob(f"{JOB}-*{JOURNAL_SUFFIX}")
    r = JournalReader(path)
    try:
        return [x for x in r.read_range(0, r.head()) if x.kind == RecordKind.OP]
    finally:
        r.close()


def test_collective_held_on_the_device_is_a_named_hang_then_completes(tmp_path: Path) -> None:
    run_dir, timeline, ctl = tmp_path / "run", tmp_path / "timeline", tmp_path / "ctl"
    for d in (run_dir, timeline, ctl):
        d.mkdir()
    env = dict(
        os.environ,
        DIAG_RUN_DIR=str(run_dir),
        DIAG_JOB=JOB,
        OMP_NUM_THREADS="1",
        TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
    )
    agent_cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
        "--timeline", str(timeline), "--job", JOB, "--hang-timeout", "8", "--hang-floor", "2",
        "--warmup-timeout", "8", "--on-hang", "none", "--until", "job-end", "--interval",
        "0.25", "-v",
    ]  # fmt: skip
    agent_log, job_log = tmp_path / "agent.log", tmp_path / "job.log"
    agent = start(agent_cmd, agent_log, env)
    job = start(command(1, JOB_SCRIPT, "--ctl", str(ctl)), job_log, env)
    try:
        _wait(lambda: (ctl / "held").exists(), 120, "the hold", job_log)
        held = json.loads((ctl / "held").read_text())
        _wait(lambda: _incidents(timeline), 60, "the agent's incident", agent_log)
        # Held: the journal says enqueued on the host, not started on the device.
        ops = _ops(run_dir)
        last = ops[-1]
        assert last.op == OpCode.ALL_REDUCE and OpFlag.CUDA in OpFlag(last.flags)
        assert last.state == OpState.ENQUEUED, last
        assert all(o.state == OpState.COMPLETED for o in ops[:-1])
        incident = _incidents(timeline)[0]
        v = json.loads((incident / VERDICT_FILE).read_text())
        assert v["kind"] == "hang", v
        assert [w["waiting_ranks"] for w in v["waits"]] == [[0]], v["waits"]
        tail = json.loads((incident / "00000-00001.journal.json").read_text())
        assert tail["records"][-1]["state"] == "enqueued", tail["records"][-1]
        assert list(incident.glob("00000-00001*.stack.json")), sorted(incident.iterdir())
        # The rank is named: its collective never started on the device, nobody else waits.
        assert v["culprit"] == 0, v
        assert v["suspects"][0]["kind"] == "device-not-started", v["suspects"]
        assert "enqueued on the device but never started" in v["suspects"][0]["reason"]
        assert "the stream is blocked by earlier work" in v["summary"], v["summary"]
        # The agent took the rank's NCCL flight recorder while the collective was held.
        fr_file = incident / "flight-recorder" / "00000-00001.nccl.json"
        assert fr_file.is_file(), (v.get("flight_recorder"), sorted(incident.iterdir()))
        taken = json.loads(fr_file.read_text())
        held_entries = [e for e in taken["entries"] if "all_reduce" in e["profiling_name"]]
        assert held_entries and held_entries[-1]["state"] != "completed", held_entries[-1:]
        merged = merge_incident(incident)
        text = merged.summary_txt.read_text()
        assert "FLIGHT RECORDER" in text and "[nccl]" in text and "all_reduce" in text, text
        assert [r.rank for r in merged.report.flight.records] == [0], merged.report.flight
        (ctl / "release").write_text("")
        assert finish(job, 120) == 0, job_log.read_text()[-3000:]
    finally:
        stop(job)
        if agent.poll() is None:
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                stop(agent)
    assert json.loads((ctl / "done").read_text()) == {"ok": True}
    ops = _ops(run_dir)
    assert all(o.state == OpState.COMPLETED for o in ops), [o.state for o in ops]
    assert read_meta(next(run_dir.glob(f"{JOB}-*{JOURNAL_SUFFIX}"))).device == "cuda"
    print(f"hold: {held['hold']}; verdict: {v.get('summary', '')}")
    # The flight recorder, dumped while the collective was held, agrees with the journal.
    assert (ctl / "fr.json").exists(), (ctl / "fr.error").read_text()
    fr = json.loads((ctl / "fr.json").read_text())
    entries = [e for e in fr.get("entries", []) if "all_reduce" in str(e.get("profiling_name"))]
    assert entries, sorted(fr)
    assert entries[-1]["state"] != "completed", entries[-1]
    assert held["hold"] == "flag", held
