"""The alert rules and the dashboard as files: promtool checks and unit tests, no drift between
the plain rules and the PrometheusRule, every family on the dashboard."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from repo import ROOT

from diag.agent.metrics import families as f

PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "diag-alerts.yaml"
OPERATOR_RULES = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "diag-dashboard.json"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is missing: install the Debian package `prometheus` (scripts/bootstrap.sh)",
)

# What the alerts must cover: hang, straggler, stale checkpoint, /dev/shm, precheck, GPU, agent.
REQUIRED_ALERTS = {
    "DiagTrainingHang",
    "DiagRankStraggler",
    "DiagCheckpointStale",
    "DiagShmNearlyFull",
    "DiagPrecheckNodeFaulty",
    "DiagPrecheckFailed",
    "DiagGpuXidError",
    "DiagGpuEccError",
    "DiagAgentDown",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def exposed_names() -> set[str]:
    return {n for fam in f.FAMILIES for n in fam.exposed}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(diag_[a-z0-9_]+|up)\b", expr))


@needs_promtool
def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    # The operator's manifest wraps the same groups: check its spec as a rules file too.
    spec = yaml.safe_load(OPERATOR_RULES.read_text())["spec"]
    extracted = tmp_path / "from-prometheusrule.yaml"
    extracted.write_text(yaml.safe_dump(spec))
    r = promtool("check", "rules", str(extracted))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_rules_pass_their_unit_tests() -> None:
    tests = sorted((PROM / "tests").glob("*.yaml"))
    assert tests
    r = promtool("test", "rules", *map(str, tests))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_prometheusrule_has_the_same_rules() -> None:
    manifest = yaml.safe_load(OPERATOR_RULES.read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_alerts_cover_the_failures_and_name_real_families() -> None:
    by_name = {r["alert"]: r for r in rules()}
    assert set(by_name) >= REQUIRED_ALERTS
    known = exposed_names()
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        names = metric_names(rule["expr"])
        assert names, name
        for metric in names:
            assert metric in known or metric == "up" or metric.startswith("diag_precheck_"), (
                f"{name} reads {metric}, which the agent does not export"
            )
    # Every test file exercises every rule at least once.
    tested = set()
    for path in (PROM / "tests").glob("*.yaml"):
        for t in yaml.safe_load(path.read_text())["tests"]:
            tested |= {a["alertname"] for a in t.get("alert_rule_test", ())}
    assert tested == set(by_name)


def test_podmonitor_honors_labels_and_names_the_job_the_down_alert_matches() -> None:
    pm = yaml.safe_load((ROOT / "deploy/k8s/base/podmonitor.yaml").read_text())
    assert pm["kind"] == "PodMonitor"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True
    down = next(r for r in rules() if r["alert"] == "DiagAgentDown")
    regex = re.search(r'job=~"([^"]+)"', down["expr"]).group(1)
    assert re.fullmatch(regex, f"training/{pm['metadata']['name']}")


# -- dashboard ------------------------------------------------------------------------------------


def dashboard_builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    sys.path.insert(0, str(GRAFANA))  # it imports diag_panels from its own folder
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(GRAFANA))
        del sys.modules[spec.name]
        sys.modules.pop("diag_panels", None)
    return module


def dashboard_queries(d: dict) -> list[str]:
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", ())]
    exprs += [a["expr"] for a in d["annotations"]["list"]]
    return exprs


def test_dashboard_json_matches_its_builder() -> None:
    builder = dashboard_builder()
    assert DASHBOARD.read_text() == builder.render(), (
        "deploy/grafana/diag-dashboard.json is out of date: run "
        "python deploy/grafana/build_dashboard.py"
    )
    # The Grafana sidecar's ConfigMap carries the same dashboard, byte for byte.
    configmap = builder.CONFIGMAP.read_text()
    assert configmap == builder.configmap(DASHBOARD.read_text())
    doc = yaml.safe_load(configmap)
    assert doc["data"] == {"diag-dashboard.json": DASHBOARD.read_text()}
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_dashboard_has_a_panel_for_every_family() -> None:
    d = json.loads(DASHBOARD.read_text())
    used = set().union(*(metric_names(q) for q in dashboard_queries(d)))
    missing = [fam.name for fam in f.FAMILIES if not set(fam.exposed) & used]
    assert not missing, f"families without a panel: {missing}"
    known = exposed_names()
    for name in used:
        assert name in known or name == "up" or name.startswith("diag_precheck_"), name
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", ()):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_docs_reference_lists_every_family() -> None:
    """The docs' metric families page (generated at build time by docsite/reference.py) lists
    exactly the declared families, in its section for the agent."""
    spec = importlib.util.spec_from_file_location(
        "docsite_reference", ROOT / "docsite/reference.py"
    )
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    text = reference.metrics_page()
    section = text[text.index("## The agent") : text.index("## xpu_timer")]
    listed = set(re.findall(r"^\| `([A-Za-z0-9_]+)` \|", section, flags=re.M))
    declared = {fam.exposed[0] if fam.kind == f.Kind.COUNTER else fam.name for fam in f.FAMILIES}
    assert listed == declared
