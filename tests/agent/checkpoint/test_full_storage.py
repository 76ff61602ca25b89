"""Out of room, on real mounts: a full save directory, a full shared-memory directory and a timeline
that turns read-only, each under a real 2-rank DeepSpeed job and a real agent. Each gives an error
that names the problem and what to do, and loses nothing already committed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from flash_launch import Workspace, wait_for
from killchecks import incomplete

from diag.agent.checkpoint.storage import MARKER_DIR, marker_path
from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import find_slots, read_latest_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(
        # Private, as the agent wants a run directory (a tmpfs root is 1777 by default).
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)]
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def ws():
    root = Path(tempfile.mkdtemp(prefix="diag-test-full-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-full-run-", dir="/dev/shm"))
    try:
        yield Workspace(root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def agent(ws: Workspace, job: str, timeline: Path) -> Iterator[subprocess.Popen]:
    cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(ws.run_dir),
        "--job", job, "--timeline", str(timeline), "--native-stacks", "false",
        "--interval", "0.25", "-v",
    ]  # fmt: skip
    with open(ws.root / "agent.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=ws.env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(control_socket_path(ws.run_dir, job).exists, 60), agent_log(ws)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def agent_log(ws: Workspace) -> str:
    return (ws.root / "agent.log").read_text(errors="replace")


def unmarked_parts(save: Path) -> list[str]:
    """Files in step directories that no rank's marker of that step lists."""
    out = []
    for step_dir in save.glob("global_step*"):
        listed: set[str] = set()
        for m in (save / MARKER_DIR / step_dir.name).glob("rank*.done"):
            listed.update(json.loads(m.read_text())["files"])
        out += [
            f"{step_dir.name}/{f.name}"
            for f in step_dir.iterdir()
            if f"{step_dir.name}/{f.name}" not in listed and not f.name.startswith(".")
        ]
    return sorted(out)


def test_full_save_dir_is_named_and_loses_nothing_committed(ws: Workspace) -> None:
    save = ws.save / "z2"
    with tmpfs(save, "1m"), agent(ws, "flash-z2", ws.root / "timeline"):
        filler = save / "filler"
        filler.write_bytes(b"\0" * (420 << 10))  # leaves room for about two steps
        with open(ws.root / "full.log", "wb") as log:
            job = subprocess.Popen(
                ws.command("--out", str(ws.root / "full"), "--zero", "2", "--hidden", "64",
                           "--persist-every", "1", "--wait-commands", "0.3", "--steps", "80"),
                env=ws.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            assert wait_for(lambda: "is full" in agent_log(ws), 180), agent_log(ws)[-3000:]
            at_full = read_latest_step(save)
            assert at_full is not None and not incomplete(save, at_full, 2)
            # Every part that could not be completed is gone again: the room stays usable.
            assert wait_for(lambda: not unmarked_parts(save), 10), unmarked_parts(save)
            filler.unlink()  # room again: the next steps commit
            assert wait_for(lambda: (read_latest_step(save) or 0) > at_full, 120), agent_log(ws)[
                -3000:
            ]
            assert job.wait(240) == 0, ws.log("full")
        finally:
            if job.poll() is None:
                job.kill()
                job.wait(10)
        final = read_latest_step(save)
        assert final is not None and not incomplete(save, final, 2)
        assert not unmarked_parts(save), unmarked_parts(save)
    text = agent_log(ws)
    assert "Free space there" in text and "--keep-last" in text, text[-3000:]
    assert f"`latest` still names step {at_full}" in text
    assert "Traceback" not in text
    assert "is full" in ws.log("full"), "the trainer hears why its step is not on storage"


def test_full_shared_memory_is_named_and_loses_nothing_committed(ws: Workspace) -> None:
    save = ws.save / "z2"
    with agent(ws, "flash-z2", ws.root / "timeline"):
        rc = ws.launch(
            "first", "--zero", "2", "--persist-every", "1", "--steps", "4",
            "--wait-commands", "0.3",
        )  # fmt: skip
        assert rc == 0, ws.log("first")
        assert wait_for(lambda: read_latest_step(save) is not None, 60), agent_log(ws)[-3000:]
    committed = read_latest_step(save)
    assert committed is not None
    # A restart on a node whose shared memory is too small for the snapshots.
    with tmpfs(ws.root / "shm", "256k") as small:
        small_ws = Workspace(ws.root, small)
        rc = small_ws.launch("small", "--zero", "2", "--persist-every", "1", "--steps", "8")
    assert rc != 0
    log = ws.log("small")
    assert "ShmSpaceError" in log and "--shm-size" in log and "sizeLimit" in log, log
    assert ws.start("small", 2) == {"step": committed, "from": "storage"}
    assert read_latest_step(save) == committed and not incomplete(save, committed, 2)
    assert marker_path(save, committed, 1).exists()


def test_timeline_turned_read_only_is_named_and_checkpoints_persist(ws: Workspace) -> None:
    timeline = ws.root / "timeline"
    save = ws.save / "z2"
    with tmpfs(timeline, "1m"), agent(ws, "flash-z2", timeline) as proc:
        subprocess.run(["mount", "-o", "remount,ro", str(timeline)], check=True)
        rc = ws.launch("kill", "--zero", "2", "--attach", "--kill-step", "3")
        assert rc != 0, ws.log("kill")
        assert wait_for(lambda: read_latest_step(save) == 3, 60), agent_log(ws)[-3000:]
        assert wait_for(lambda: "could not write the incident" in agent_log(ws), 30)
        assert proc.poll() is None, "the agent goes on"
    text = agent_log(ws)
    assert "Read-only file system" in text and "Make the timeline writable" in text, text
    assert "Traceback" not in text
    assert not incomplete(save, 3, 2)


def test_shared_memory_filling_up_mid_run_loses_nothing(ws: Workspace) -> None:
    """The slots are allocated for the whole job at its first save: shared memory that fills up
    afterwards (another process's segments) changes nothing, and a rank killed later still has
    its newest step persisted by the agent."""
    save = ws.save / "z2"
    with tmpfs(ws.root / "shm", "16m") as small:
        small_ws = Workspace(ws.root, small)
        with agent(small_ws, "flash-z2", ws.root / "timeline"):
            with open(ws.root / "fill.log", "wb") as log:
                job = subprocess.Popen(
                    small_ws.command("--out", str(ws.root / "fill"), "--zero", "2",
                                     "--wait-commands", "0.5", "--steps", "40",
                                     "--kill-step", "10"),
                    env=small_ws.env(), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            try:
                assert wait_for(lambda: len(find_slots(small, "flash-z2")) >= 2, 120), ws.log(
                    "fill"
                )
                filler = small / "neighbour.seg"
                with open(filler, "wb") as f, contextlib.suppress(OSError):
                    while True:
                        f.write(b"\1" * (1 << 20))
                        f.flush()
                assert shutil.disk_usage(small).free < (1 << 20)
                assert job.wait(240) != 0, "rank 1 is killed at step 10"
            finally:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait(10)
            assert wait_for(lambda: read_latest_step(save) == 10, 60), agent_log(ws)[-3000:]
    assert not incomplete(save, 10, 2)
    assert "Traceback" not in agent_log(ws)
