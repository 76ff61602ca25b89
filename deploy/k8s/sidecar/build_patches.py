"""Writes the kustomize Component of the diag sidecar: patches/<target>.yaml (JSON patches) and
kustomization.yaml, from sidecar.yaml, for each kind of workload in TARGETS.

    python deploy/k8s/sidecar/build_patches.py     # rewrites them next to it

The outputs are committed; tests/deploy/test_deploy_workloads.py checks they match this script.
One definition, one patch per pod template: a PyTorchJob has two (Master, Worker); a JobSet's
first replicated job gets it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
SOURCE = HERE / "sidecar.yaml"
HEADER = "# Written by build_patches.py from sidecar.yaml: edit those, not this file.\n"


@dataclass(frozen=True)
class Target:
    name: str  # the patch file's name
    kind: str
    template: str  # the JSON pointer of the pod template
    job_label: str  # the label the operator sets on every pod to the job's name
    # The node's name in the job (DIAG_NODE, the same in the agent and the trainer): the pod's
    # place, which a replacement pod keeps (the Kubernetes node and the pod's name do not), as
    # `prefix-index`, the index from these labels, joined by "-".
    node_prefix: str
    node_labels: tuple[str, ...]


TARGETS = (
    Target("elasticjob", "ElasticJob", "/spec/replicaSpecs/worker/template", "elasticjob.dlrover/name",
           "worker", ("elasticjob.dlrover/rank-index",)),
    Target("pytorchjob-master", "PyTorchJob", "/spec/pytorchReplicaSpecs/Master/template",
           "training.kubeflow.org/job-name", "master", ("training.kubeflow.org/replica-index",)),
    Target("pytorchjob-worker", "PyTorchJob", "/spec/pytorchReplicaSpecs/Worker/template",
           "training.kubeflow.org/job-name", "worker", ("training.kubeflow.org/replica-index",)),
    Target("job", "Job", "/spec/template", "batch.kubernetes.io/job-name",
           "worker", ("batch.kubernetes.io/job-completion-index",)),
    # A JobSet's first replicated job (the examples have one): its job's index, then the pod's.
    Target("jobset", "JobSet", "/spec/replicatedJobs/0/template/spec/template",
           "jobset.sigs.k8s.io/jobset-name", "worker",
           ("jobset.sigs.k8s.io/job-index", "batch.kubernetes.io/job-completion-index")),
)  # fmt: skip


def node_env(target: Target) -> list[dict[str, Any]]:
    """DIAG_NODE and the downward-API variables it is made of (defined before it: the kubelet
    expands $(VAR) only from variables listed earlier)."""
    env: list[dict[str, Any]] = []
    parts = [target.node_prefix]
    for i, label in enumerate(target.node_labels):
        name = f"DIAG_NODE_INDEX{i or ''}"
        ref = {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}
        env.append({"name": name, "valueFrom": ref})
        parts.append(f"$({name})")
    env.append({"name": "DIAG_NODE", "value": "-".join(parts)})
    return env


def _key(name: str) -> str:
    """A map key as a JSON pointer token."""
    return name.replace("~", "~0").replace("/", "~1")


def operations(source: dict[str, Any], target: Target) -> list[dict[str, Any]]:
    """The JSON patch that adds the sidecar to one pod template."""
    text = json.dumps(source).replace("$JOB_LABEL", target.job_label)
    src = json.loads(text)
    src["initContainers"][0].setdefault("env", []).extend(node_env(target))
    src["trainer"].setdefault("env", []).extend(node_env(target))
    t = target.template
    ops: list[dict[str, Any]] = []
    for name, value in src["podLabels"].items():
        ops.append({"op": "add", "path": f"{t}/metadata/labels/{_key(name)}", "value": value})
    for name, value in src["podSpec"].items():
        ops.append({"op": "add", "path": f"{t}/spec/{name}", "value": value})
    ops.append({"op": "add", "path": f"{t}/spec/initContainers", "value": src["initContainers"]})
    for volume in src["volumes"]:
        ops.append({"op": "add", "path": f"{t}/spec/volumes/-", "value": volume})
    for field, items in src["trainer"].items():
        for item in items:
            ops.append({"op": "add", "path": f"{t}/spec/containers/0/{field}/-", "value": item})
    return ops


def kustomization() -> dict[str, Any]:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "patches": [
            {"path": f"patches/{t.name}.yaml", "target": {"kind": t.kind}} for t in TARGETS
        ],
    }


def outputs() -> dict[Path, str]:
    source = yaml.safe_load(SOURCE.read_text())
    out = {
        HERE / "patches" / f"{t.name}.yaml": HEADER
        + yaml.safe_dump(operations(source, t), sort_keys=False, width=100)
        for t in TARGETS
    }
    out[HERE / "kustomization.yaml"] = (
        HEADER + "# The diag sidecar for a job's pod templates: `components: [../sidecar]` in its"
        " kustomization.\n" + yaml.safe_dump(kustomization(), sort_keys=False)
    )
    return out


def main() -> int:
    for path, text in outputs().items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
