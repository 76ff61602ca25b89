"""The Kubernetes manifests in deploy/k8s render (kustomize) and validate against the Kubernetes
schemas (kubernetes-validate, strict: unknown fields are errors), and say what the docs say
(operator/deployment.md, operator/rbac.md): least-privilege RBAC, SYS_PTRACE on the sidecar only,
a native sidecar, the agent's flags valid, in the pods of every example workload."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from kustomizer import WORKLOADS, pod_templates, render
from repo import ROOT

from diag.agent.config import agentconfig as agent_config
from diag.agent.taint.taintconfig import TaintMode

K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "namespace", "policy", *WORKLOADS, "expiry", "monitoring"]
# The oldest release with everything used here (ValidatingAdmissionPolicy v1, native sidecars,
# the node name in service account tokens) and the newest the schemas know.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def workload_pods(rendered):
    """(example, replica, pod template) of every example workload."""
    return [
        (name, replica, template)
        for name in WORKLOADS
        for doc in rendered[name]
        for replica, template in pod_templates(doc)
    ]


@pytest.fixture(scope="module")
def rendered():
    return {k: render(K8S / k) for k in KUSTOMIZATIONS}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl (kustomize) installed")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renderer_matches_kubectl_kustomize(name, rendered):
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]

    def key(d):
        return (d["kind"], d["metadata"]["name"])

    assert sorted(theirs, key=key) == sorted(rendered[name], key=key)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifests_validate_against_the_schemas(name, version, rendered):
    checked = 0
    for doc in rendered[name]:
        if doc["kind"] in ("ElasticJob", "PyTorchJob", "JobSet"):
            # A custom resource: each replica's pod template is a core PodTemplateSpec.
            for _, spec in pod_templates(doc):
                template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": doc["metadata"]["name"]},
                    "template": spec,
                }
                kubernetes_validate.validate(template, version, strict=True)
                checked += 1
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus Operator's CRD; tests/agent/metrics/test_alert_rules.py checks it
        else:
            kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
    assert checked


def test_a_broken_manifest_is_caught():
    """The validator does reject what the API server would: a typo'd field, a wrong type."""
    doc = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}, "automount": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_rbac_is_least_privilege(rendered):
    (role,) = by_kind(rendered["policy"], "ClusterRole")
    rules = sorted(
        (tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])))
        for r in role["rules"]
    )
    assert rules == [
        (("",), ("events",), ("create",)),
        (("",), ("nodes",), ("get", "patch")),
        (("",), ("nodes/status",), ("patch",)),
    ]
    assert not by_kind(rendered["base"], "ClusterRole")  # cluster-wide, once: ../policy
    (binding,) = by_kind(rendered["namespace"], "ClusterRoleBinding")
    (account,) = by_kind(rendered["namespace"], "ServiceAccount")
    assert binding["metadata"]["name"] == "diag-agent-training"  # one per namespace
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "diag-agent", "namespace": "training"}
    ]
    assert account["metadata"]["namespace"] == "training"
    for d in rendered["policy"]:
        assert "namespace" not in d["metadata"]  # cluster-scoped


def test_the_pods(rendered):
    pods = workload_pods(rendered)
    # The ElasticJob's workers, the PyTorchJob's master and workers, the Job, the JobSet's workers.
    assert len(pods) == 5
    for _, _, pod in pods:
        check_pod(pod, rendered)


def check_pod(pod, rendered):
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "diag-agent" and spec["shareProcessNamespace"]
    assert spec["securityContext"]["runAsNonRoot"]
    (sidecar,) = spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    for c in spec["containers"]:
        caps = c.get("securityContext", {}).get("capabilities", {})
        assert not caps.get("add"), f"{c['name']} adds capabilities"
        assert caps.get("drop") == ["ALL"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # One node name in the job for the agent and its ranks, the worker's place, which a
    # relaunched worker keeps (not the Kubernetes node nor the pod's host name): the same
    # definition in both containers, made of the operator's index labels only.
    agent_node, trainer_node = (node_definition(c) for c in (sidecar, spec["containers"][0]))
    assert agent_node == trainer_node and agent_node[1], agent_node
    assert all(ref.startswith("metadata.labels['") for ref in agent_node[1])
    # The PodMonitor finds the pod and its port.
    (monitor,) = by_kind(rendered["namespace"], "PodMonitor")
    labels = monitor["spec"]["selector"]["matchLabels"]
    assert labels.items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for p in sidecar["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    # Both containers see the journals at the same path: a directory inside a shared volume,
    # not the volume's root, which the kubelet makes 0777 (the agent refuses such a run dir).
    run_dir = env["DIAG_RUN_DIR"]["value"]
    for c in (sidecar, *spec["containers"]):
        assert {e["name"]: e for e in c["env"]}["DIAG_RUN_DIR"]["value"] == run_dir
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert run_dir not in mounts
        assert any(run_dir.startswith(m.rstrip("/") + "/") for m in mounts)


def node_definition(container):
    """A container's DIAG_NODE: its value and the fields of the variables it names, each defined
    before it (the kubelet expands $(VAR) only from earlier variables)."""
    env = container["env"]
    names = [e["name"] for e in env]
    assert "DIAG_NODE" in names, container["name"]
    at = names.index("DIAG_NODE")
    value = env[at]["value"]
    earlier = {e["name"]: e for e in env[:at]}
    refs = []
    for var in re.findall(r"\$\((\w+)\)", value):
        assert var in earlier, f"{container['name']}: DIAG_NODE names {var} before it is defined"
        refs.append(earlier[var]["valueFrom"]["fieldRef"]["fieldPath"])
    return value, tuple(refs)


TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_only_the_sidecar_holds_the_token(rendered):
    """No service account token in the trainer's container: the pod mounts none automatically,
    the agent mounts a projected one where the kubernetes client's in-cluster config reads it."""
    (account,) = by_kind(rendered["namespace"], "ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    for _, _, pod in workload_pods(rendered):
        check_token(pod["spec"])


def check_token(spec):
    assert spec["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}

    def token_sources(c):
        out = []
        for m in c.get("volumeMounts", []):
            for src in volumes[m["name"]].get("projected", {}).get("sources", []):
                if "serviceAccountToken" in src:
                    out.append((m, src["serviceAccountToken"]))
        return out

    for c in spec["containers"]:
        assert not token_sources(c), f"{c['name']} mounts a service account token"
        assert all(m["mountPath"] != TOKEN_DIR for m in c.get("volumeMounts", []))
    (sidecar,) = spec["initContainers"]
    ((mount, token),) = token_sources(sidecar)
    assert mount["mountPath"] == TOKEN_DIR and mount["readOnly"] is True
    assert token["path"] == "token" and "audience" not in token  # the API server's audience
    assert 600 <= token["expirationSeconds"] <= 3600  # the API server's minimum, an hour
    # The rest of what in-cluster config and the automatic mount provide: the CA, the namespace.
    files = {
        item["path"]
        for src in volumes[mount["name"]]["projected"]["sources"]
        for kind in ("configMap", "downwardAPI")
        for item in src.get(kind, {}).get("items", [])
    }
    assert files == {"ca.crt", "namespace"}


def test_the_in_cluster_client_reads_the_projected_token(rendered, tmp_path):
    """The real kubernetes client's in-cluster loader takes the files the sidecar's volume
    makes, at the paths the manifest mounts them, as its token and CA."""
    from kubernetes import client
    from kubernetes.config import incluster_config

    (job,) = by_kind(rendered["elasticjob"], "ElasticJob")
    spec = job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]
    (sidecar,) = spec["initContainers"]
    (mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == TOKEN_DIR]
    where = mount["mountPath"]
    assert (f"{where}/token", f"{where}/ca.crt") == (
        incluster_config.SERVICE_TOKEN_FILENAME,
        incluster_config.SERVICE_CERT_FILENAME,
    )
    # The volume's files, laid out under a stand-in for the mount path.
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    root = tmp_path / "sa"
    root.mkdir()
    for src in volume["projected"]["sources"]:
        if "serviceAccountToken" in src:
            (root / src["serviceAccountToken"]["path"]).write_text("projected-token")
        for kind in ("configMap", "downwardAPI"):
            for item in src.get(kind, {}).get("items", []):
                (root / item["path"]).write_text("x")
    loader = incluster_config.InClusterConfigLoader(
        token_filename=str(root / "token"),
        cert_filename=str(root / "ca.crt"),
        environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
    )
    cfg = client.Configuration()
    loader.load_and_set(cfg)
    assert cfg.auth_settings()["BearerToken"]["value"] == "bearer projected-token"
    assert cfg.ssl_ca_cert == str(root / "ca.crt")


@pytest.mark.parametrize("example", WORKLOADS)
def test_the_sidecar_flags_are_the_agent_s(rendered, example):
    """The sidecar's args and env parse with the real `diag agent` parser; the drain plans within
    the grace period the pod will really have."""
    for doc in rendered[example]:
        for _, pod in pod_templates(doc):
            check_flags(pod["spec"])


def check_flags(spec):
    (sidecar,) = spec["initContainers"]
    args = sidecar["args"]
    assert args[0] == "agent"
    parser = argparse.ArgumentParser()
    agent_config.add_arguments(parser)
    # As the kubelet fills them in: the downward API's fields (every index label 3), then
    # $(VAR) in later values from the variables before them.
    env: dict[str, str] = {}
    fields = {"spec.nodeName": "node-a", "metadata.namespace": "training"}
    for e in sidecar["env"]:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = fields.get(ref, "3" if ref.startswith("metadata.labels[") else "")
    cfg = agent_config.load(parser.parse_args(args[1:]), env=env)
    assert cfg.taint.mode == TaintMode.ON and cfg.taint.event_namespace == "training"
    # The job knows the node as the pod's place; its taints go on the Kubernetes node.
    assert re.fullmatch(r"(worker|master)(-3)+", cfg.node), cfg.node
    assert cfg.metrics_port == 9400 and cfg.taint.kube_node == "node-a"
    # The drain plans within the pod's grace period, not the 30 s default.
    assert cfg.drain is not None and cfg.drain.grace == spec["terminationGracePeriodSeconds"]


def test_the_expiry_cronjob(rendered):
    from diag.cli import untaintcmd

    docs = rendered["expiry"]
    (role,) = by_kind(docs, "ClusterRole")
    verbs = {tuple(r["resources"]): sorted(r["verbs"]) for r in role["rules"]}
    assert verbs == {
        ("nodes",): ["get", "list", "patch"],
        ("nodes/status",): ["patch"],
        ("events",): ["create"],
    }
    # Its patch right is narrowed by its own admission policy, shipped with it, cluster-scoped.
    policies = by_kind(docs, "ValidatingAdmissionPolicy")
    bindings = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert (
        {p["metadata"]["name"] for p in policies}
        == {b["spec"]["policyName"] for b in bindings}
        == {"diag-taint-expiry-removes-only", "diag-taint-expiry-events"}
    )
    assert all("namespace" not in d["metadata"] for d in policies + bindings)
    (account,) = by_kind(docs, "ServiceAccount")
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "diag-taint-expiry", "namespace": "diag-system"}
    ]
    assert account["metadata"]["namespace"] == "diag-system"
    (cron,) = by_kind(docs, "CronJob")
    assert cron["metadata"]["namespace"] == "diag-system"
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["args"][0] == "untaint"
    parser = argparse.ArgumentParser()
    untaintcmd.add_arguments(parser)
    args = parser.parse_args(c["args"][1:])
    assert args.expired and args.node is None
