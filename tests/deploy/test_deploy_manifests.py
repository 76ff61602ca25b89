"""The Kubernetes manifests in deploy/k8s render (kustomize) and validate against the Kubernetes
schemas (kubernetes-validate, strict: unknown fields are errors), and say what the docs say (operator/deployment.md, operator/rbac.md):
least-privilege RBAC, SYS_PTRACE on the sidecar only, a native sidecar, the agent's flags valid."""

from __future__ import annotations

import argparse
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from kustomizer import render
from repo import ROOT

from diag.agent.config import agentconfig as agent_config
from diag.agent.taint.taintconfig import TaintMode

K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "policy", "elasticjob", "expiry"]
# The oldest release with everything used here (ValidatingAdmissionPolicy v1, native sidecars,
# the node name in service account tokens) and the newest the schemas know.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


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
        if doc["kind"] == "ElasticJob":
            # A custom resource: its worker's pod template is a core PodTemplateSpec.
            for spec in doc["spec"]["replicaSpecs"].values():
                template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": doc["metadata"]["name"]},
                    "template": spec["template"],
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
    (role,) = by_kind(rendered["base"], "ClusterRole")
    rules = sorted(
        (tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])))
        for r in role["rules"]
    )
    assert rules == [
        (("",), ("events",), ("create",)),
        (("",), ("nodes",), ("get", "patch")),
        (("",), ("nodes/status",), ("patch",)),
    ]
    (binding,) = by_kind(rendered["elasticjob"], "ClusterRoleBinding")
    (account,) = by_kind(rendered["elasticjob"], "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "diag-agent", "namespace": "training"}
    ]
    assert account["metadata"]["namespace"] == "training"
    for d in rendered["policy"]:
        assert "namespace" not in d["metadata"]  # cluster-scoped


def test_the_pod(rendered):
    (job,) = by_kind(rendered["elasticjob"], "ElasticJob")
    pod = job["spec"]["replicaSpecs"]["worker"]["template"]
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
    # relaunched worker keeps (not the Kubernetes node nor the pod's host name).
    for c in (sidecar, *spec["containers"]):
        named = {e["name"]: e for e in c["env"]}
        assert named["DIAG_NODE"]["value"] == "worker-$(DIAG_RANK_INDEX)", c["name"]
        index = named["DIAG_RANK_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert index == "metadata.labels['elasticjob.dlrover/rank-index']", c["name"]
    # The PodMonitor finds the pod and its port.
    (monitor,) = by_kind(rendered["elasticjob"], "PodMonitor")
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


TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_only_the_sidecar_holds_the_token(rendered):
    """No service account token in the trainer's container: the pod mounts none automatically,
    the agent mounts a projected one where the kubernetes client's in-cluster config reads it."""
    (job,) = by_kind(rendered["elasticjob"], "ElasticJob")
    spec = job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    (account,) = by_kind(rendered["elasticjob"], "ServiceAccount")
    assert account["automountServiceAccountToken"] is False
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


def test_the_sidecar_flags_are_the_agent_s(rendered, tmp_path):
    """The sidecar's args and env parse with the real `diag agent` parser."""
    (job,) = by_kind(rendered["elasticjob"], "ElasticJob")
    (sidecar,) = job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["initContainers"]
    args = sidecar["args"]
    assert args[0] == "agent"
    parser = argparse.ArgumentParser()
    agent_config.add_arguments(parser)
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    # As the kubelet fills them in: the downward API's fields, then $(VAR) in later values.
    env.update(NODE_NAME="node-a", POD_NAMESPACE="training", DIAG_RANK_INDEX="3")
    env["DIAG_NODE"] = env["DIAG_NODE"].replace("$(DIAG_RANK_INDEX)", "3")
    cfg = agent_config.load(parser.parse_args(args[1:]), env=env)
    assert cfg.taint.mode == TaintMode.ON and cfg.taint.event_namespace == "training"
    # The job knows the node as the worker's place; its taints go on the Kubernetes node.
    assert cfg.metrics_port == 9400 and cfg.node == "worker-3" and cfg.taint.kube_node == "node-a"
    # The drain plans within the pod's grace period, not the 30 s default.
    grace = job["spec"]["replicaSpecs"]["worker"]["template"]["spec"]
    assert cfg.drain is not None and cfg.drain.grace == grace["terminationGracePeriodSeconds"]


def test_podmonitor_in_the_base_is_the_shipped_one():
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/diag-podmonitor.yaml").read_text())
    base = yaml.safe_load((K8S / "base/podmonitor.yaml").read_text())
    assert base == shipped


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
