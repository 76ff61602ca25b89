"""End to end: a real Prometheus scrapes a real agent while the demo's job hangs; the hang alert
fires through Prometheus's HTTP API, and every dashboard query runs against that Prometheus."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from children import terminate
from repo import ROOT

from diag.cli.demo import DemoResult, DemoSettings, run_demo
from diag.formats.rundir import node_name

RULES = ROOT / "deploy" / "prometheus" / "diag-alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "diag-dashboard.json"
FIRE_TIMEOUT = 150.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None
        or (
            shutil.which("py-spy") is None and not Path(sys.executable).with_name("py-spy").exists()
        ),
        reason="needs the Debian package `prometheus` and py-spy (scripts/bootstrap.sh)",
    ),
]

# A precheck's textfile as `diag precheck --metrics-file` writes it, re-exported by the agent.
PRECHECK_TEXT = """\
# TYPE diag_precheck_exit_code gauge
diag_precheck_exit_code{job="demo"} 4
# TYPE diag_precheck_node_status gauge
diag_precheck_node_status{job="demo",node="n1",status="healthy"} 1
diag_precheck_node_status{job="demo",node="n1",status="faulty"} 0
diag_precheck_node_status{job="demo",node="n2",status="healthy"} 0
diag_precheck_node_status{job="demo",node="n2",status="faulty"} 1
# TYPE diag_precheck_busbw_bytes_per_second gauge
diag_precheck_busbw_bytes_per_second{job="demo",node="n1"} 2.1e+10
# TYPE diag_precheck_link_failed gauge
diag_precheck_link_failed{job="demo",node="n1",peer="n2"} 1
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    prom: str  # base URL of Prometheus
    started: float  # unix time the demo started
    fired_after: float  # seconds from the demo's start to the hang alert firing
    alert: dict
    demo_out: io.StringIO
    demo: dict

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.prom}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]


def api_or_none(base: str, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"{base}/api/v1/{path}", timeout=10) as r:
            return json.loads(r.read())["data"]
    except OSError:
        return None


def short_rules(tmp: Path) -> Path:
    """The shipped rules with every `for:` cut to 1 s, so the test need not wait minutes."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@contextlib.contextmanager
def prometheus(tmp: Path, target_port: int) -> Iterator[str]:
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(short_rules(tmp))],
        "scrape_configs": [
            {
                "job_name": "diag-agent",
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while api_or_none(base, "status/buildinfo") is None:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus did not come up"
            time.sleep(0.3)
        yield base
    finally:
        terminate(proc)
        log.close()


def firing(base: str, name: str) -> dict | None:
    data = api_or_none(base, "alerts")
    for a in (data or {}).get("alerts", ()):
        if a["labels"].get("alertname") == name and a["state"] == "firing":
            return a
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prom-e2e")
    agent_port = free_port()
    workdir = tmp / "demo"
    (workdir / "run").mkdir(parents=True)
    (workdir / "run" / "precheck.prom").write_text(PRECHECK_TEXT)
    opts = DemoSettings(
        nproc=4,
        fault="hang",
        fault_rank=1,
        fault_step=12,
        hang_timeout=15.0,
        hang_floor=3.0,
        on_hang="none",  # the ranks stay stuck: the hang is still there when we look
        timeout=FIRE_TIMEOUT + 60,
        workdir=workdir,
        merge=False,
        metrics_port=agent_port,
        agent_args=("--metrics-host", "127.0.0.1", "--xpu-timer-compat", "true"),
    )
    with prometheus(tmp, agent_port) as base:
        stop = threading.Event()
        out = io.StringIO()
        result: dict[str, DemoResult] = {}
        demo = threading.Thread(
            target=lambda: result.setdefault("r", run_demo(opts, out, stop)), daemon=True
        )
        started, t0 = time.time(), time.monotonic()
        demo.start()
        try:
            alert = None
            while alert is None and time.monotonic() - t0 < FIRE_TIMEOUT and demo.is_alive():
                time.sleep(1.0)
                alert = firing(base, "DiagTrainingHang")
            fired_after = time.monotonic() - t0
            assert alert is not None, (
                f"no DiagTrainingHang after {fired_after:.0f} s\n{out.getvalue()}\n"
                + (workdir / "agent.log").read_text()[-3000:]
            )
            s = Stack(base, started, fired_after, alert, out, result)
            # Wait for the evidence too, so its families are in the scrape.
            deadline = time.monotonic() + 60
            while not s.api("query", query="diag_evidence_seconds_count")["result"]:
                assert time.monotonic() < deadline, "evidence durations never showed up"
                time.sleep(1.0)
            time.sleep(3.0)  # a few more scrapes: range queries' last steps then include it
            yield s
        finally:
            stop.set()
            demo.join(timeout=60)


def test_hang_alert_fires_through_prometheus(stack: Stack) -> None:
    labels = stack.alert["labels"]
    assert labels["job"] == "demo" and labels["node"] == node_name()
    assert labels["severity"] == "critical"

    def q(expr: str) -> list[dict]:
        return stack.api("query", query=expr)["result"]

    culprit = q('diag_rank_culprit{job="demo"} == 1')
    assert [r["metric"]["rank"] for r in culprit] == ["1"]
    assert q('sum(diag_rank_hung{job="demo"})')[0]["value"][1] == "4"
    # DLRover's view: xpu_timer's gauge reads 1 on every rank.
    xpu = q("XPU_TIMER_COMMON_HANG")
    assert sorted(r["metric"]["rank"] for r in xpu) == ["0", "1", "2", "3"]
    assert {r["value"][1] for r in xpu} == {"1"}
    print(f"hang alert fired {stack.fired_after:.1f} s after the demo started")


def dashboard_queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", ())]
    out += [(a["name"], a["expr"]) for a in d["annotations"]["list"]]
    return out


def grafana_to_promql(expr: str) -> str:
    for var, value in (
        ("$__rate_interval", "1m"),
        ("$__range", "5m"),
        ("$job", ".*"),
        ("$node", ".*"),
    ):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_query_runs_against_live_prometheus(stack: Stack) -> None:
    present = set(stack.api("label/__name__/values"))
    assert "diag_rank_step" in present and "diag_host_cpu_cores" in present
    end = time.time()
    checked_with_data = 0
    for title, expr in dashboard_queries():
        promql = grafana_to_promql(expr)
        data = stack.api(
            "query_range", query=promql, start=stack.started, end=end, step="2s"
        )  # a query that does not parse fails here with status "error"
        names = set(re.findall(r"\b(diag_[a-z0-9_]+|up|XPU_TIMER_[A-Z_]+)\b", promql))
        if names <= present:
            assert data["result"], f"{title}: {promql} returned nothing"
            checked_with_data += 1
    # Only the checkpoint and GPU families are absent here (no flash checkpoint, no GPU).
    print(f"{checked_with_data} dashboard queries returned data")
    assert checked_with_data >= 40
    d = json.loads(DASHBOARD.read_text())
    for var in d["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var["query"]
        values = stack.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
        assert values, var["name"]
