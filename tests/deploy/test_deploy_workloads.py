"""The example workloads share one sidecar (deploy/k8s/sidecar, a kustomize Component written by
its build_patches.py), the per-namespace objects are safe to apply in many namespaces and to
delete from one, and the DLRover example tells the agent the grace period DLRover's pods have.
Rendering and schema validation of every example: test_deploy_manifests.py."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kustomizer import CLUSTER_SCOPED, WORKLOADS, pod_templates, render
from repo import ROOT

K8S = ROOT / "deploy" / "k8s"


def build_patches():
    spec = importlib.util.spec_from_file_location("build_patches", K8S / "sidecar/build_patches.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_patches"] = module
    spec.loader.exec_module(module)
    return module


def test_the_component_is_what_its_script_writes():
    for path, text in build_patches().outputs().items():
        assert path.read_text() == text, f"{path}: run python deploy/k8s/sidecar/build_patches.py"


def test_every_example_has_the_same_sidecar():
    """One definition: the sidecar of every pod of every example is the component's, apart from
    what an example overrides on purpose (DLRover's grace, below)."""
    sidecars = {}
    for example in WORKLOADS:
        examples_yaml = (K8S / example / "kustomization.yaml").read_text()
        assert "- ../sidecar" in examples_yaml
        for doc in render(K8S / example):
            for replica, pod in pod_templates(doc):
                (sidecar,) = pod["spec"]["initContainers"]
                sidecar = dict(sidecar, args=[a for a in sidecar["args"] if "grace" not in a])
                env = sidecar.pop("env")
                label = next(e for e in env if e["name"] == "DIAG_JOB")
                # The job's name, from the label its operator sets on every pod.
                path = label["valueFrom"]["fieldRef"]["fieldPath"]
                assert path.endswith(("job-name']", "jobset-name']", "elasticjob.dlrover/name']"))
                sidecars[(example, replica)] = sidecar
    assert len(sidecars) == 5 and all(s == next(iter(sidecars.values())) for s in sidecars.values())


def test_the_dlrover_example_plans_within_the_30_s_dlrover_gives():
    (job,) = [d for d in render(K8S / "elasticjob") if d["kind"] == "ElasticJob"]
    ((_, pod),) = pod_templates(job)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30
    (sidecar,) = pod["spec"]["initContainers"]
    graces = [a for a in sidecar["args"] if a.startswith("--termination-grace=")]
    assert graces[-1] == "--termination-grace=30"  # the last of a repeated flag wins


@pytest.mark.skipif(
    importlib.util.find_spec("dlrover") is None, reason="dlrover is not installed"
)  # fmt: skip
def test_dlrover_still_makes_worker_pods_without_the_template_s_grace():
    """Why the DLRover example says 30 s: its pod scaler gives _create_pod_obj no
    termination_period, which it writes to the pod (None: Kubernetes' default, 30 s). When a
    DLRover release passes it, the example can keep the component's 120 s."""
    import dlrover.python.master.scaler.pod_scaler as scaler

    tree = ast.parse(Path(scaler.__file__).read_text())
    calls = [
        node
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name == "_create_pod"
        for node in ast.walk(fn)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_create_pod_obj"
    ]
    assert calls and all("termination_period" not in {k.arg for k in c.keywords} for c in calls)
    (obj,) = [
        fn
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name == "_create_pod_obj"
    ]
    assert "pod.spec.termination_grace_period_seconds = termination_period" in ast.unparse(obj)


def identity(doc):
    return (
        doc["apiVersion"],
        doc["kind"],
        doc["metadata"].get("namespace"),
        doc["metadata"]["name"],
    )


def render_namespace(tmp_path: Path, namespace: str, kubectl: bool) -> list[dict]:
    """deploy/k8s/namespace with its namespace set, as `kustomize edit set namespace` would."""
    root = tmp_path / namespace
    shutil.copytree(K8S / "base", root / "base")
    shutil.copytree(K8S / "namespace", root / "namespace")
    k = root / "namespace" / "kustomization.yaml"
    spec = yaml.safe_load(k.read_text())
    spec["namespace"] = namespace
    k.write_text(yaml.safe_dump(spec))
    if not kubectl:
        return render(root / "namespace")
    out = subprocess.run(
        ["kubectl", "kustomize", str(root / "namespace")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize(
    "kubectl",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl"),
        ),
    ],
)
def test_two_namespaces_apply_and_delete_apart(tmp_path, kubectl):
    """The namespace objects of team-a and team-b: no object in common (applying team-b changes
    nothing of team-a's, deleting team-b's deletes nothing of team-a's), each binding grants its
    own namespace's account."""
    a = render_namespace(tmp_path, "team-a", kubectl)
    b = render_namespace(tmp_path, "team-b", kubectl)
    assert {identity(d) for d in a}.isdisjoint({identity(d) for d in b})
    for namespace, docs in (("team-a", a), ("team-b", b)):
        for d in docs:
            if d["kind"] in CLUSTER_SCOPED:
                assert d["kind"] == "ClusterRoleBinding", d["kind"]  # the rest: ../policy
                assert d["metadata"]["name"] == f"diag-agent-{namespace}"
                assert {s["namespace"] for s in d["subjects"]} == {namespace}
            else:
                assert d["metadata"]["namespace"] == namespace
        (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
        # Its own namespace only (the default), so two namespaces never scrape a pod twice.
        assert "namespaceSelector" not in monitor["spec"]
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_monitoring_objects_carry_the_selector_labels():
    """The release label a default kube-prometheus-stack selects rules by, on the rules; the
    label Grafana's dashboard sidecar watches, on the dashboard."""
    docs = {d["kind"]: d for d in render(K8S / "monitoring")}
    assert set(docs) == {"PrometheusRule", "ConfigMap"}
    for d in docs.values():
        assert d["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert d["metadata"]["namespace"] == "monitoring"
    assert docs["ConfigMap"]["metadata"]["labels"]["grafana_dashboard"] == "1"
