"""The package as the images install it: the agent image's build stage builds a wheel from what it
copies (read from the Dockerfile) and installs that file, never the source tree; the trainer
target installs the same file into the user's training image.

Default tier: the wheel from exactly the build stage's inputs, installed into an empty virtualenv
(uv, seconds), runs `diag --version` and the agent without torch, and carries the license. Long
tier: the build stage's own step, as the Dockerfile writes it, run outside a container with its
paths pointed at a temporary directory (pip resolves against the index: minutes on 2 cores). The
image build itself is opt-in (test_image_build.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from dockerfile import stages
from repo import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# What the build stage's step is given: its paths, each through a variable.
PATHS = {"DIAG_SRC": "/src", "DIAG_DIST": "/dist", "DIAG_VENV": "/opt/diag"}


def build_stage_copies() -> list[str]:
    """The repository paths the `build` stage COPYs into /src (no --from copies)."""
    out: list[str] = []
    for source, paths, dest in stages()["build"].copies():
        if not source and dest.startswith("/src"):
            out += paths
    return out


def copy_inputs(src: Path) -> None:
    src.mkdir()
    for name in build_stage_copies():
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)


def test_the_image_copies_the_package_whole() -> None:
    copies = build_stage_copies()
    assert "diag" in copies and "pyproject.toml" in copies and "LICENSE" in copies, copies
    # Nothing else of the repository is needed to build: a room left out failed the image.
    assert set(copies) <= {"diag", "pyproject.toml", "README.md", "LICENSE"}, copies


def test_every_image_installs_the_wheel_and_not_the_source_tree() -> None:
    all_stages = stages()
    build = all_stages["build"]
    assert {k: build.env().get(k) for k in PATHS} == PATHS
    (step,) = build.runs()
    # The step names its paths only through the variables (the long test moves them).
    for path in PATHS.values():
        assert not re.search(rf"(?<![\w$/]){re.escape(path)}(?![\w-])", step), (path, step)
    assert '"$DIAG_VENV/bin/pip" wheel --no-deps --wheel-dir "$DIAG_DIST" "$DIAG_SRC"' in step
    install = re.search(r'"\$DIAG_VENV/bin/pip" install (\S+)', step)
    assert install and install.group(1) == '"$1[k8s]"', step  # $1: the wheel the glob found
    assert 'set -- "$DIAG_DIST"/diag-*.whl' in step
    # The agent runs that venv; the trainer target installs that same wheel.
    assert ("build", ["/opt/diag"], "/opt/diag") in all_stages["agent"].copies()
    trainer = all_stages["trainer"]
    assert trainer.image == "${TRAINER_BASE}"
    assert ("build", ["/dist/"], "/tmp/diag-dist/") in trainer.copies()
    (run,) = trainer.runs()
    assert "-m pip install --no-cache-dir /tmp/diag-dist/diag-*.whl" in run


def test_the_wheel_from_the_image_inputs_runs_the_agent_without_torch(tmp_path: Path) -> None:
    src = tmp_path / "src"
    copy_inputs(src)
    dist = tmp_path / "dist"
    # The project venv's setuptools builds it: no index is asked for a build environment.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(src)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("diag-*.whl")
    assert wheel.name == f"diag-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        license_text = z.read(f"diag-{VERSION}.dist-info/licenses/LICENSE").decode()
    assert license_text == (ROOT / "LICENSE").read_text() and "Apache License" in license_text
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    uv = Path(sys.executable).with_name("uv")
    installer = (
        [str(uv), "pip", "install", "-q", "--python", str(python)]
        if uv.exists()
        else [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    )
    subprocess.run([*installer, str(wheel)], check=True, timeout=300)
    check_installed(venv, tmp_path)


def check_installed(venv: Path, cwd: Path) -> None:
    """The venv's diag: the agent importable and runnable without torch, `diag --version`."""
    probe = (
        "import sys, diag.agent.loop.daemon, diag.cli.main, diag.viewer.merge, "
        "diag.agent.privilege.dumper\n"
        "assert 'torch' not in sys.modules, 'the agent imported torch'\n"
        "import diag.agent.loop.daemon as d\n"
        "print(d.__file__)\n"
    )
    # Away from the repository, whose diag/ folder `-c` would import first.
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        capture_output=True, text=True, timeout=120, cwd=cwd,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert str(venv) in r.stdout, r.stdout  # the installed copy, not the repository
    diag = str(venv / "bin" / "diag")
    help_ = subprocess.run(
        [diag, "agent", "--help"], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert help_.returncode == 0 and "--trainer-uid" in help_.stdout, help_.stderr
    version = subprocess.run(
        [diag, "--version"], capture_output=True, text=True, timeout=60, cwd=cwd
    )
    assert (version.returncode, version.stdout) == (0, f"diag {VERSION}\n"), version


@pytest.mark.long
def test_the_build_stage_step_builds_the_agent_venv_from_the_wheel(tmp_path: Path) -> None:
    """The build stage's RUN, as written, with /src, /dist and /opt/diag moved under tmp_path:
    a wheel, a venv with that wheel and the kubernetes client (its asyncio half gone), no pip,
    no torch; the venv's diag is file for file the wheel's."""
    src = tmp_path / "src"
    copy_inputs(src)
    paths = {"DIAG_SRC": src, "DIAG_DIST": tmp_path / "dist", "DIAG_VENV": tmp_path / "venv"}
    (step,) = stages()["build"].runs()
    # Debian's python3 where there is one, as in the image: not this test's venv.
    env = {
        "PATH": "/usr/bin:/bin:/usr/local/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        **{k: str(v) for k, v in paths.items()},
    }
    for key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
        if key in os.environ:
            env[key] = os.environ[key]
    r = subprocess.run(
        ["/bin/sh", "-c", step], capture_output=True, text=True, timeout=840, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    venv = paths["DIAG_VENV"]
    (wheel,) = paths["DIAG_DIST"].glob("diag-*.whl")
    check_installed(venv, tmp_path)
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not (site / "kubernetes" / "aio").exists() and (site / "kubernetes" / "client").is_dir()
    assert not (venv / "bin" / "pip").exists()
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("diag/"):
                assert (site / name).read_bytes() == z.read(name), name
