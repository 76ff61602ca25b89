"""A renderer for the subset of kustomize that deploy/k8s uses, so the manifests render and
validate where no kustomize binary is installed: `resources` (files and directories with their
own kustomization.yaml), `components` (directories whose kustomization is a Component: their
patches applied to what the including kustomization holds, before its own transformers),
`namespace` (namespaced kinds, and the namespace of ServiceAccount subjects of role bindings),
`labels` with `pairs` (metadata labels only), `patches` (JSON patches, inline or from a file,
ops add, replace and remove, a target by kind and name), `replacements` (a source field into
target fields, whole or one delimited part), and `images` (`newName`/`newTag` on containers and
init containers, in pod templates at any depth).
Where `kubectl kustomize` exists, tests/deploy/test_deploy_manifests.py checks both render the same."""

from __future__ import annotations

import json
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
SUPPORTED = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "namespace",
    "labels",
    "patches",
    "replacements",
    "images",
}


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
    # Through JSON: YAML anchors (one template for two replicas) become separate objects.
    docs = [json.loads(json.dumps(d)) for d in docs]
    for entry in spec.get("components", []):
        _patch(docs, directory / entry)
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
    _patch(docs, directory, spec)
    for image in spec.get("images", []):
        for d in docs:
            _set_image(d, image)
    for replacement in spec.get("replacements", []):
        _replace(docs, replacement)
    return docs


# The example workloads of deploy/k8s, each a directory with the sidecar component.
WORKLOADS = ["elasticjob", "pytorchjob", "torchrun-job", "jobset"]


def pod_templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(replica, PodTemplateSpec) of a workload: a custom resource's replicas, a Job's template."""
    if doc["kind"] == "ElasticJob":
        return [(name, spec["template"]) for name, spec in doc["spec"]["replicaSpecs"].items()]
    if doc["kind"] == "PyTorchJob":
        return [(k, v["template"]) for k, v in doc["spec"]["pytorchReplicaSpecs"].items()]
    if doc["kind"] == "JobSet":
        return [
            (r["name"], r["template"]["spec"]["template"]) for r in doc["spec"]["replicatedJobs"]
        ]
    if doc["kind"] in ("Job", "Deployment", "StatefulSet"):
        return [("", doc["spec"]["template"])]
    return []


def _patch(docs: list[dict[str, Any]], directory: Path, spec: dict[str, Any] | None = None) -> None:
    """The `patches` of a kustomization (a component's when spec is None) applied to docs."""
    if spec is None:
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
        unknown = set(spec) - {"apiVersion", "kind", "patches"}
        if spec.get("kind") != "Component" or unknown:
            raise KustomizeError(f"{directory}: not a Component of patches only")
    for entry in spec.get("patches", []):
        text = entry["patch"] if "patch" in entry else (directory / entry["path"]).read_text()
        ops = yaml.safe_load(text)
        target = entry.get("target", {})
        for d in docs:
            if all(d.get(k) == v for k, v in target.items() if k == "kind") and all(
                d["metadata"].get(k) == v for k, v in target.items() if k == "name"
            ):
                for op in ops:
                    _apply(d, op)


def _apply(doc: dict[str, Any], op: dict[str, Any]) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        value = json.loads(json.dumps(op["value"]))
        if last == "-":
            node.append(value)
        elif op["op"] == "add":
            node.insert(int(last), value)
        else:
            node[int(last)] = value
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace" and last not in node:
            raise KustomizeError(f"replace of a missing field: {op['path']}")
        node[last] = json.loads(json.dumps(op["value"]))
    else:
        raise KustomizeError(f"a JSON patch op this renderer does not know: {op['op']}")


def _replace(docs: list[dict[str, Any]], replacement: dict[str, Any]) -> None:
    def select(sel: dict[str, str]) -> list[dict[str, Any]]:
        return [
            d
            for d in docs
            if d["kind"] == sel["kind"]
            and d["metadata"]["name"] == sel.get("name", d["metadata"]["name"])
        ]

    def field(d: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        return d, last

    source = replacement["source"]
    (src,) = select(source)
    holder, key = field(src, source["fieldPath"])
    value = holder[key]
    for target in replacement["targets"]:
        for d in select(target["select"]):
            for path in target["fieldPaths"]:
                holder, key = field(d, path)
                options = target.get("options", {})
                if "delimiter" in options:
                    parts = holder[key].split(options["delimiter"])
                    parts[options["index"]] = value
                    holder[key] = options["delimiter"].join(parts)
                else:
                    holder[key] = value


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
