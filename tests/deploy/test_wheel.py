"""The package as the agent image builds it: the wheel from exactly what the image's build stage
copies (read from the Dockerfile), installed into an empty virtualenv, and the agent importable
and runnable there without torch. The image build itself is opt-in (test_image_build.py, minutes);
this is the part of it that drifts when a room is added or moved."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DOCKERFILE = ROOT / "deploy" / "image" / "Dockerfile"


def build_stage_copies(dockerfile: str) -> list[str]:
    """The repository paths the `build` stage COPYs into /src (no --from copies)."""
    stage = dockerfile.split(" AS build", 1)[1].split("\nFROM ", 1)[0]
    out: list[str] = []
    for line in stage.splitlines():
        m = re.match(r"COPY (?!--from)(.+) /src/\S*$", line)
        if m:
            out += m.group(1).split()
    return out


def test_the_image_copies_the_package_whole() -> None:
    copies = build_stage_copies(DOCKERFILE.read_text())
    assert "diag" in copies and "pyproject.toml" in copies, copies
    # Nothing else of the repository is needed to build: a room left out failed the image.
    assert set(copies) <= {"diag", "pyproject.toml", "README.md", "LICENSE"}, copies


def test_the_wheel_from_the_image_inputs_runs_the_agent_without_torch(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in build_stage_copies(DOCKERFILE.read_text()):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    # The project venv's setuptools builds it: no index is asked for a build environment.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(src)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("diag-*.whl")
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
    probe = (
        "import sys, diag.agent.loop.daemon, diag.cli.main, diag.viewer.merge, "
        "diag.agent.privilege.dumper\n"
        "assert 'torch' not in sys.modules, 'the agent imported torch'\n"
        "import diag.agent.loop.daemon as d\n"
        "print(d.__file__)\n"
    )
    # Away from the repository, whose diag/ folder `-c` would import first.
    r = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert str(venv) in r.stdout, r.stdout  # the installed copy, not the repository
    help_ = subprocess.run(
        [str(venv / "bin" / "diag"), "agent", "--help"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert help_.returncode == 0 and "--trainer-uid" in help_.stdout, help_.stderr
