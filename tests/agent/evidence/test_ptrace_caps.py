"""The non-root sidecar: only py-spy carries CAP_SYS_PTRACE (a file capability, as the image
sets it), so an agent running as an unprivileged user can dump a process of another user, and
`can_trace` tells when that will work (capability granted by the container, no no_new_privs).

Real processes under real user ids (setpriv); needs root to set them up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from diag.agent.evidence.pyspy import CAP_SYS_PTRACE, file_has_capability, pyspy_binary

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setcap") or not shutil.which("setpriv"),
    reason="needs root, setcap and setpriv",
)
AGENT_UID, TRAINER_UID = 65534, 65533


@pytest.fixture
def bindir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-caps-", dir="/dev/shm"))
    os.chmod(d, 0o755)
    capable, plain = d / "capable", d / "plain"
    capable.mkdir(mode=0o755)
    plain.mkdir(mode=0o755)
    for where in (capable, plain):
        shutil.copy2(pyspy_binary(), where / "py-spy")
        os.chmod(where / "py-spy", 0o755)
    subprocess.run(["setcap", "cap_sys_ptrace+ep", str(capable / "py-spy")], check=True)
    try:
        yield capable, plain
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_user(uid: int, *args: str, extra: tuple[str, ...] = ()) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *extra, *args]


def test_file_capability_is_read(bindir):
    capable, plain = bindir
    assert file_has_capability(str(capable / "py-spy"), CAP_SYS_PTRACE)
    assert not file_has_capability(str(plain / "py-spy"), CAP_SYS_PTRACE)
    assert not file_has_capability(str(capable / "py-spy"), 21)  # CAP_SYS_ADMIN: not given


def test_non_root_dumps_another_users_process_only_with_the_capable_pyspy(bindir):
    capable, plain = bindir
    trainer = subprocess.Popen(
        as_user(TRAINER_UID, sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)")
    )
    try:
        pid = trainer.pid  # setpriv execs the interpreter: the PID is the Python process's
        deadline = time.monotonic() + 60
        while True:  # until the interpreter is up
            ok = subprocess.run(
                as_user(AGENT_UID, str(capable / "py-spy"), "dump", "--pid", str(pid)),
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if (ok.returncode == 0 and "<module>" in ok.stdout) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ok.returncode == 0, ok.stderr
        assert "<module>" in ok.stdout
        refused = subprocess.run(
            as_user(AGENT_UID, str(plain / "py-spy"), "dump", "--pid", str(pid)),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode != 0
    finally:
        trainer.kill()
        trainer.wait(timeout=10)


@pytest.mark.parametrize(
    "which, extra, expected",
    [
        ("capable", (), True),
        ("plain", (), False),
        ("capable", ("--no-new-privs",), False),  # allowPrivilegeEscalation: false
        ("capable", ("--bounding-set=-sys_ptrace",), False),  # SYS_PTRACE not added
    ],
)
def test_can_trace_as_the_agent_user(bindir, which, extra, expected):
    capable, plain = bindir
    path = capable if which == "capable" else plain
    env = dict(os.environ, PATH=f"{path}:/usr/bin:/bin")
    code = "from diag.agent.evidence.pyspy import can_trace; print(can_trace())"
    r = subprocess.run(
        as_user(AGENT_UID, sys.executable, "-c", code, extra=extra),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(expected)
