"""A renderer for the subset of kustomize that deploy/k8s uses, so the manifests render and
validate where no kustomize binary is installed: `resources` (files and directories with their
own kustomization.yaml), `namespace` (namespaced kinds, and the namespace of ServiceAccount
subjects of role bindings), `labels` with `pairs` (metadata labels only), and `images`
(`newName`/`newTag` on containers and init containers, in pod templates at any depth).
Where `kubectl kustomize` exists, tests/deploy/test_deploy_manifests.py checks both render the same."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "Namespace",
    "Node",
    "PersistentVolume",
    "StorageClass",
    "CustomResourceDefinition",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    "PriorityClass",
}
SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "labels", "images"}


class KustomizeError(Exception):
    pass


def render(directory: Path) -> list[dict[str, Any]]:
    kfile = directory / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{kfile}: fields this renderer does not know: {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    docs = [copy.deepcopy(d) for d in docs]
    namespace = spec.get("namespace")
    if namespace:
        accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = namespace
            if d["kind"] in ("ClusterRoleBinding", "RoleBinding"):
                for s in d.get("subjects", []):
                    if s.get("kind") == "ServiceAccount" and s.get("name") in accounts:
                        s["namespace"] = namespace
    for label in spec.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(label.get("pairs", {}))
    for image in spec.get("images", []):
        for d in docs:
            _set_image(d, image)
    return docs


def _set_image(node: Any, image: dict[str, str]) -> None:
    if isinstance(node, dict):
        for key in ("containers", "initContainers"):
            for c in node.get(key, []) if isinstance(node.get(key), list) else []:
                name, _, tag = c.get("image", "").partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
        for value in node.values():
            _set_image(value, image)
    elif isinstance(node, list):
        for value in node:
            _set_image(value, image)
