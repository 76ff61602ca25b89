"""Stack evidence from real processes: a process in uninterruptible sleep (D state) gets its state
recorded and a non-blocking dump instead of one that would hang; a process that is gone gets a
clear error; stacks of several processes are taken together."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from diag.agent.evidence.pyspy import DumpTarget, dump_all
from diag.agent.observe.procs import proc_state

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def _frozen_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A loop-mounted ext4 frozen with fsfreeze: whoever writes to it waits in D state."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount and freeze a filesystem")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={image}", "bs=1M", "count=16", "status=none"], check=True
    )
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)]).returncode != 0:
        pytest.skip("loop mounts are not available here")
    try:
        subprocess.run(["fsfreeze", "-f", str(mnt)], check=True)
        try:
            yield mnt
        finally:
            subprocess.run(["fsfreeze", "-u", str(mnt)], check=False)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _wait_state(pid: int, want: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while proc_state(pid) != want:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {want}"
        time.sleep(0.05)


def test_process_in_d_state_is_not_dumped_with_a_blocking_read(tmp_path: Path) -> None:
    with _frozen_filesystem(tmp_path) as mnt:
        writer = _python(
            "import os, time\n"
            "time.sleep(1)\n"  # let py-spy find the interpreter first
            f"f = open('{mnt}/x', 'w'); f.write('x' * 100); f.flush(); os.fsync(f.fileno())\n"
        )
        try:
            # Blocked in the kernel, the writer is in D state, but it can flip to R for a moment
            # (a wake-up that finds the filesystem still frozen): dump until a dump sees D.
            for _ in range(10):
                _wait_state(writer.pid, "D")
                t0 = time.monotonic()
                (dump,) = dump_all([DumpTarget(0, 1, writer.pid)], native=True, timeout=15)
                took = time.monotonic() - t0
                assert took < 10, f"took {took:.1f} s: {dump}"  # it never hangs on the process
                if dump.process_state.startswith("D"):
                    break
            else:
                pytest.fail(f"no dump saw the writer in D state: {dump}")
            assert not dump.native, dump  # no ptrace stop, no native unwinding
            if not dump.error and dump.threads:  # a non-blocking read usually sees the frame
                funcs = [f.func for t in dump.threads for f in t.frames]
                assert "<module>" in funcs, dump
        finally:
            writer.kill()
    writer.wait(timeout=30)


def test_gone_process_and_several_at_once(tmp_path: Path) -> None:
    sleepers = [_python("import time\ndef idle():\n    time.sleep(60)\nidle()\n") for _ in range(3)]
    gone = _python("pass")
    gone.wait(timeout=30)
    try:
        for p in sleepers:
            _wait_state(p.pid, "S")
        time.sleep(1.0)
        targets = [DumpTarget(r, 4, p.pid) for r, p in enumerate(sleepers)]
        targets.append(DumpTarget(3, 4, gone.pid))
        dumps = dump_all(targets, native=False, timeout=30)
        assert [d.rank for d in dumps] == [0, 1, 2, 3]
        for d in dumps[:3]:
            assert not d.error and d.process_state.startswith("S")
            assert "idle" in [f.func for t in d.threads for f in t.frames]
        assert "exited" in dumps[3].error
    finally:
        for p in sleepers:
            p.kill()
            p.wait(timeout=30)


@pytest.mark.parametrize(
    ("room_mib", "native_at_once"),
    [(4096, 2), (300, 0)],  # room for both dumps at once; less than one native dump needs
)
def test_native_pass_follows_the_memory_left(tmp_path: Path, room_mib: int, native_at_once) -> None:
    """The incident path with the container's limits given: native dumps run as many at once as
    fit; when not even one fits, the Python stacks stay and the verdict says why."""
    import datetime as dt
    import json

    from diag.agent.evidence.collection import EvidenceTarget, capture, verdict_document
    from diag.agent.observe.containerlimits import ContainerLimits, MemoryLimit

    sleepers = [_python("import time\ndef idle():\n    time.sleep(60)\nidle()\n") for _ in range(2)]
    try:
        for p in sleepers:
            _wait_state(p.pid, "S")
        time.sleep(0.5)
        targets = [EvidenceTarget(DumpTarget(r, 2, p.pid)) for r, p in enumerate(sleepers)]
        now = dt.datetime.now(dt.UTC)
        doc = verdict_document(
            None, kind="manual", incident_id="t", job="j", node="n", world_size=2,
            detected_at=now, summary="test",
        )  # fmt: skip
        limits = ContainerLimits(cpus=8, memory=(MemoryLimit(room_mib << 20, 0, "/cg"),))
        result = capture(targets, tmp_path, doc, native=True, pyspy_timeout=30, limits=limits)
        ev = json.loads((result.path / "verdict.json").read_text())["evidence"]
        assert ev["native_parallel"] == native_at_once, ev
        assert ev["native_pending"] is False
        assert [d.native for d in result.dumps] == [native_at_once > 0] * 2
        for d in result.dumps:
            assert not d.error and "idle" in [f.func for t in d.threads for f in t.frames]
        if native_at_once == 0:
            assert "one dump needs" in ev["native_parallel_reason"]
            assert "/cg" in ev["native_parallel_reason"]
    finally:
        for p in sleepers:
            p.kill()
            p.wait(timeout=30)


def test_native_dumps_start_two_then_as_many_as_their_measured_size_allows(tmp_path: Path) -> None:
    """The per-dump cost the agent assumes can be wrong for an image (more libraries, more
    symbols): two native dumps start first, and the peak resident size py-spy really reached
    decides how many run after them. Here the assumed cost (1 MiB) would let all four run at
    once in 40 MiB; a real py-spy --native takes ~20 MiB, so the rest go one at a time."""
    import datetime as dt
    import json

    from diag.agent.evidence.collection import EvidenceTarget, capture, verdict_document
    from diag.agent.evidence.parallelism import RESERVE_BYTES, DumpCost
    from diag.agent.observe.containerlimits import ContainerLimits, MemoryLimit

    sleepers = [_python("import time\ndef idle():\n    time.sleep(60)\nidle()\n") for _ in range(4)]
    try:
        for p in sleepers:
            _wait_state(p.pid, "S")
        time.sleep(0.5)
        targets = [EvidenceTarget(DumpTarget(r, 4, p.pid)) for r, p in enumerate(sleepers)]
        doc = verdict_document(
            None, kind="manual", incident_id="t", job="j", node="n", world_size=4,
            detected_at=dt.datetime.now(dt.UTC), summary="test",
        )  # fmt: skip
        room = RESERVE_BYTES + (40 << 20)
        limits = ContainerLimits(cpus=8, memory=(MemoryLimit(room, 0, "/cg"),))
        result = capture(
            targets, tmp_path, doc, native=True, pyspy_timeout=30, limits=limits,
            native_cost=DumpCost(each=1 << 20),
        )  # fmt: skip
        ev = json.loads((result.path / "verdict.json").read_text())["evidence"]
        assert ev["native_parallel"] == 2, ev
        assert "2 first, then as their measured size allows" in ev["native_parallel_reason"]
        assert ev["native_peak_mib"] > 5, ev
        assert 1 <= ev["native_parallel_measured"] < 4, ev
        assert "/cg" in ev["native_parallel_measured_reason"], ev
        assert all(d.native and not d.error for d in result.dumps), result.dumps
    finally:
        for p in sleepers:
            p.kill()
            p.wait(timeout=30)


def _set_file_capability(path: Path, cap: int) -> None:
    """setcap cap+ep without libcap's tools: struct vfs_cap_data, revision 2, effective bit."""
    import struct

    os.setxattr(path, "security.capability", struct.pack("<5I", 0x02000001, 1 << cap, 0, 0, 0))


def test_pyspy_refused_by_the_kernel_still_leaves_an_incident(tmp_path: Path) -> None:
    """The non-root image: py-spy carries cap_sys_ptrace as a file capability, and a container
    without SYS_PTRACE in its bounding set makes the kernel refuse to run it (EPERM at exec). The
    incident is still written, each rank's dump naming the cause, instead of the exec's error
    aborting the capture."""
    import json
    import shutil

    from diag.agent.evidence.pyspy import CAP_SYS_PTRACE, file_has_capability, pyspy_binary

    if os.geteuid() != 0:
        pytest.skip("needs root to set a file capability and drop it from the bounding set")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    pyspy = bindir / "py-spy"
    shutil.copy2(pyspy_binary(), pyspy)
    try:
        _set_file_capability(pyspy, CAP_SYS_PTRACE)
    except OSError as e:
        pytest.skip(f"no security.capability xattrs on {tmp_path}: {e}")
    assert file_has_capability(str(pyspy), CAP_SYS_PTRACE)
    timeline = tmp_path / "timeline"
    sleeper = _python("import time\ndef idle():\n    time.sleep(60)\nidle()\n")
    child = f"""
import ctypes, datetime as dt, json, sys
from pathlib import Path
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(24, {CAP_SYS_PTRACE}, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, as a container would
    sys.exit(f"PR_CAPBSET_DROP failed: errno {{ctypes.get_errno()}}")
from diag.agent.evidence.collection import EvidenceTarget, capture, verdict_document
from diag.agent.evidence.pyspy import DumpTarget
doc = verdict_document(None, kind="manual", incident_id="t", job="j", node="n", world_size=1,
                       detected_at=dt.datetime.now(dt.UTC), summary="test")
result = capture([EvidenceTarget(DumpTarget(0, 1, {sleeper.pid}))], Path({str(timeline)!r}),
                 doc, native=True, pyspy_timeout=30)
print(json.dumps({{"path": str(result.path), "errors": [d.error for d in result.dumps]}}))
"""
    try:
        _wait_state(sleeper.pid, "S")
        env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
        r = subprocess.run(
            [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(out["path"]).is_dir() and Path(out["path"]).is_relative_to(timeline)
    assert (Path(out["path"]) / "verdict.json").is_file()
    (error,) = out["errors"]
    assert "py-spy could not be started" in error and "Operation not permitted" in error, error
    assert "SYS_PTRACE" in error, error
