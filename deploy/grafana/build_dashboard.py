"""Writes diag-dashboard.json, the Grafana dashboard of the diag agent's metrics, and the same
dashboard as a ConfigMap for the Grafana sidecar (deploy/k8s/monitoring/grafana-dashboard.yaml).

    python deploy/grafana/build_dashboard.py      # rewrites both

The JSON is committed; tests check it matches this script, that every family the agent declares
has a panel, and that every query runs against a live Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from diag_panels import ANNOTATIONS, ROWS, P  # next to this script

OUT = Path(__file__).with_name("diag-dashboard.json")
CONFIGMAP = Path(__file__).parents[1] / "k8s" / "monitoring" / "grafana-dashboard.yaml"
DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24


def _variables() -> list[dict]:
    def query_var(name: str, query: str) -> dict:
        return {
            "name": name,
            "label": name,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "definition": query,
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        query_var("job", "label_values(diag_rank_step, job)"),
        query_var("node", 'label_values(diag_host_cpu_cores{node=~".+"}, node)'),
    ]


def _panel(p: P, pid: int, x: int, y: int) -> dict:
    targets = [
        {
            "datasource": DS,
            "expr": q.expr,
            "legendFormat": q.legend or "__auto",
            "refId": chr(ord("A") + i),
            **(
                {"instant": True, "range": False, "format": "table"}
                if p.extra.get("instant")
                else {}
            ),
        }
        for i, q in enumerate(p.queries)
    ]
    kind = "barchart" if p.kind == "bars" else p.kind
    panel: dict = {
        "id": pid,
        "type": "timeseries" if kind == "barchart" else kind,
        "title": p.title,
        "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {},
    }
    if p.description:
        panel["description"] = p.description
    if kind == "barchart":
        panel["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "bars", "fillOpacity": 80}
    if "thresholds" in p.extra:
        panel["fieldConfig"]["defaults"]["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": c, "value": v} for c, v in p.extra["thresholds"]],
        }
        panel["fieldConfig"]["defaults"]["color"] = {"mode": "thresholds"}
    if kind == "stat":
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"}
    return panel


def dashboard() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        x, line = 0, 0
        for p in row:
            if x + p.width > WIDTH:
                x, y = 0, y + line
                line = 0
            panels.append(_panel(p, pid, x, y))
            pid, x, line = pid + 1, x + p.width, max(line, p.height)
        y += line
    return {
        "title": "diag: training health",
        "uid": "diag-training-health",
        "description": "Hangs, stragglers, collectives, checkpoints, prechecks, host and GPU of "
        "jobs watched by the diag agent",
        "tags": ["diag", "training"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": _variables()},
        "annotations": {
            "list": [
                {
                    "name": name,
                    "datasource": DS,
                    "enable": True,
                    "expr": expr,
                    "titleFormat": text,
                    "iconColor": "red",
                    "step": "30s",
                }
                for name, expr, text in ANNOTATIONS
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def configmap(text: str) -> str:
    """The dashboard as a ConfigMap that Grafana's dashboard sidecar (kube-prometheus-stack's
    grafana.sidecar.dashboards) loads: it watches ConfigMaps labelled grafana_dashboard."""
    body = "".join(f"    {line}\n" for line in text.splitlines())
    return (
        "# Written by deploy/grafana/build_dashboard.py: edit that, not this file.\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: diag-dashboard\n"
        "  labels:\n"
        '    grafana_dashboard: "1"\n'
        "data:\n"
        "  diag-dashboard.json: |\n" + body
    )


if __name__ == "__main__":
    text = render()
    OUT.write_text(text)
    CONFIGMAP.write_text(configmap(text))
    print(f"wrote {OUT} and {CONFIGMAP}", file=sys.stderr)
