"""The images built for real (deploy/image/build-local.sh: a debootstrap base, buildah) and run
with podman: the agent image's CLI, user, py-spy and kubernetes client, and `diag demo` in the
demo image. Opt-in (DIAG_IMAGE_BUILD=1), as it takes minutes; needs root, buildah, podman and
debootstrap, and reaches Debian's mirror and PyPI. Images it made are removed afterwards (the
.deb cache of debootstrap stays, outside the repository)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from culpritincident import write_incident
from kubecluster import cluster
from repo import ROOT

from diag.agent.taint.planner import TAINT_KEY

SCRIPT = ROOT / "deploy" / "image" / "build-local.sh"
VERSION = "0.1.0"
BASE, AGENT, DEMO = (
    "localhost/diag-base:bookworm",
    f"localhost/diag-agent:{VERSION}",
    f"localhost/diag-demo:{VERSION}",
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _skip_reason() -> str | None:
    if os.environ.get("DIAG_IMAGE_BUILD") != "1":
        return "builds container images for minutes: set DIAG_IMAGE_BUILD=1 to run it"
    if os.geteuid() != 0:
        return "needs root (debootstrap, buildah and podman with their default storage)"
    missing = [t for t in ("buildah", "podman", "debootstrap") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install {' '.join(missing)})"
    return None


@dataclass(frozen=True)
class Podman:
    """`podman run` as build-local.sh found it works on this host: its runtime (runc where crun
    refuses the host's cgroups) and limits no higher than this shell's."""

    runtime: tuple[str, ...]
    limits: tuple[str, ...]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["podman", *self.runtime, "run", "--rm", *self.limits, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _exists(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], timeout=60).returncode == 0


@pytest.fixture(scope="module")
def built() -> Iterator[tuple[Podman, str]]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    before = {image for image in (BASE, AGENT, DEMO) if _exists(image)}
    try:
        r = subprocess.run(
            [str(SCRIPT), "--demo"], capture_output=True, text=True, timeout=1500, cwd=ROOT
        )
        print(r.stderr)  # the build's progress, times and sizes (pytest -s shows it)
        assert r.returncode == 0, r.stdout + r.stderr[-6000:]
        nofile = min(_hard_limit("-n"), 1 << 20)
        nproc = min(_hard_limit("-u"), 32768)
        runtime = ("--runtime", "runc") if "runc runs the containers" in r.stderr else ()
        limits = ("--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}")
        yield Podman(runtime, limits), r.stderr
    finally:
        made = [image for image in (DEMO, AGENT) if image not in before and _exists(image)]
        if made:
            subprocess.run(["podman", "rmi", *made], capture_output=True, timeout=300)
            # The layer cache of these builds (untagged images of the Dockerfile's stages).
            subprocess.run(
                ["podman", "image", "prune", "-f", "--filter", "label=dev.diag.stage"],
                capture_output=True,
                timeout=300,
            )
        if BASE not in before and _exists(BASE):
            subprocess.run(["podman", "rmi", BASE], capture_output=True, timeout=300)


def _hard_limit(flag: str) -> int:
    out = subprocess.run(
        ["bash", "-c", f"ulimit -H {flag}"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
    return 1 << 30 if out == "unlimited" else int(out)


def test_agent_image(built) -> None:
    podman, log = built
    assert "uid 1000, no torch, py-spy 0.4" in log and "with cap_sys_ptrace" in log, log
    r = podman.run("--network", "none", AGENT, "--help")
    assert r.returncode == 0, r.stderr
    for command in ("agent", "merge", "dump", "precheck", "demo", "taint", "untaint"):
        assert command in r.stdout, (command, r.stdout)
    r = podman.run("--network", "none", AGENT, "agent", "--help")
    assert r.returncode == 0 and "--hang-timeout" in r.stdout, r.stdout + r.stderr
    r = podman.run("--network", "none", "--entrypoint", "python3", AGENT, "-c", "import torch")
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr, r.stderr
    r = podman.run("--network", "none", "--entrypoint", "id", AGENT, "-u")
    assert r.stdout.strip() == "1000", r.stdout + r.stderr
    # py-spy's file capability is all the ptrace right there is: it works only where the
    # container has SYS_PTRACE, and the kernel refuses to start it otherwise.
    dump = (
        'python3 -c "import time\ndef idle():\n    time.sleep(60)\nidle()" & sleep 1; '
        "py-spy dump --pid $! 2>&1; rc=$?; kill $!; exit $rc"
    )
    r = podman.run("--network", "none", "--cap-add", "SYS_PTRACE", "--entrypoint", "bash",
                   AGENT, "-c", dump)  # fmt: skip
    assert r.returncode == 0 and "idle" in r.stdout, r.stdout + r.stderr
    r = podman.run("--network", "none", "--entrypoint", "bash", AGENT, "-c", dump)
    assert r.returncode != 0 and "Operation not permitted" in r.stdout + r.stderr


def test_agent_reads_the_trainer_as_in_the_pod(built) -> None:
    """The pod of deploy/k8s/elasticjob: a trainer container (uid 1000, every capability dropped,
    no privilege escalation) and the sidecar in its process namespace (uid 1000, read-only root,
    every capability dropped but SYS_PTRACE): py-spy in the sidecar dumps the trainer's stack."""
    podman, _ = built
    trainer = f"diag-test-trainer-{uuid.uuid4().hex[:8]}"
    r = podman.run(
        "-d", "--name", trainer, "--network", "none", "--user", "1000:1000", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--entrypoint", "python3", AGENT,
        "-c", "import time\ndef train_step():\n    time.sleep(600)\ntrain_step()",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    try:
        time.sleep(1)
        r = podman.run(
            "--pid", f"container:{trainer}", "--network", "none", "--read-only",
            "--cap-drop", "ALL", "--cap-add", "SYS_PTRACE", "--entrypoint", "py-spy", AGENT,
            "dump", "--pid", "1",
        )  # fmt: skip
        assert r.returncode == 0 and "train_step" in r.stdout, r.stdout + r.stderr
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", trainer], capture_output=True, timeout=60)


def test_agent_image_taints_a_node(built, tmp_path: Path) -> None:
    """The image's kubernetes client (its asyncio half removed to save space) patches a node:
    `diag taint` in the container against the in-memory API server on the host's loopback."""
    podman, _ = built
    with cluster(tmp_path) as kube:
        if kube.real:
            pytest.skip("the container reaches the in-memory API server only")
        node = kube.create_node("img")
        timeline = tmp_path / "timeline"
        for i in range(3):
            write_incident(timeline, node, f"inc-{i}")  # culprit in 3 incidents: a taint
        subprocess.run(["chown", "-R", "1000:1000", str(timeline)], check=True, timeout=30)
        r = podman.run(
            "--network", "host", "-v", f"{kube.kubeconfig}:/kubeconfig:ro",
            "-v", f"{timeline}:/timeline", "-e", "KUBECONFIG=/kubeconfig", AGENT,
            "taint", "--node", node, "--job", "llm", "--timeline", "/timeline", "--no-gpu-probe",
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert "applied" in r.stdout, r.stdout
        taints = [(t.key, t.value) for t in kube.node(node).spec.taints or []]
        assert taints == [(TAINT_KEY, "RepeatedCulprit")], taints


def test_demo_in_the_demo_image(built, tmp_path: Path) -> None:
    """build-local.sh ran `diag demo` with SYS_PTRACE: exit 0, rank 1 named, stacks merged.
    Without SYS_PTRACE the verdict still names rank 1 and the incident is written, without
    py-spy's stacks."""
    podman, log = built
    assert "diag demo exited 0" in log, log
    assert "culprit matches the injected rank" in log and "[1] at inject@" in log, log
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 1000, 1000)
    r = podman.run("--network", "none", "-v", f"{out}:/out", DEMO, "demo", "--workdir", "/out/d",
                   timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verdict: hang: rank 1 is the likely culprit" in r.stdout, r.stdout
    (incident,) = (out / "d" / "timeline").glob("*-hang-*")
    assert (incident / "verdict.json").is_file()
    agent_log = (out / "d" / "agent.log").read_text()
    assert "no ptrace permission" in agent_log
    stack = json.loads((incident / "00001-00004.stack.json").read_text())
    assert "py-spy could not be started" in stack["error"] and "SYS_PTRACE" in stack["error"]
    shutil.rmtree(out / "d", ignore_errors=True)
