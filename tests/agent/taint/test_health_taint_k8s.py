"""The agent's node-health monitors end to end: a real `diag agent` process watches a real NIC
(a veth whose peer is down) and the report file of real `diag precheck` runs, and taints its
node in the in-memory Kubernetes API (kmock, with the real `kubernetes` client) by itself, with
no incident: NicNoCarrier first, the faulty precheck added to its evidence, and once the link
is back and a clean precheck is written, the taint is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from children import terminate
from jobrun import free_port
from kubecluster import cluster
from netlab import DIAG, FAST_FLAGS, netns_unavailable
from vethpair import veth_pair

from diag.agent.taint.planner import CONDITION_TYPE, RECORD_ANNOTATION, TAINT_KEY

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(240)]


def _until(what: str, check: Callable[[], Any], log: Path, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen:\n{log.read_text(errors='replace')[-4000:]}")


def _precheck(iface: str, report: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """One node's precheck of its NIC, compute and devices, as an init container runs it."""
    return subprocess.run(
        [DIAG, "precheck", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "--nnodes", "1", "--node-rank", "0", "--iface", iface, "--report", str(report),
         *FAST_FLAGS],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip


def test_agent_taints_its_node_from_its_health_monitors(tmp_path: Path) -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    if os.environ.get("KUBECONFIG"):
        pytest.skip("needs a node the agent runs on: the in-memory API stands for it")
    report = tmp_path / "precheck.json"
    log = tmp_path / "agent.log"
    with veth_pair("dk") as nic, cluster(tmp_path) as kube:
        name = kube.create_node("health")
        bystander = kube.create_node("other")
        env = {**os.environ, "KUBECONFIG": kube.kubeconfig}
        with open(log, "wb") as out:
            agent = subprocess.Popen(
                [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir",
                 str(tmp_path / "run"), "--timeline", str(tmp_path / "timeline"), "--job",
                 "llm", "--node", name, "--control", "false", "--taint-mode", "on",
                 "--taint-watch-nics", nic.host, "--taint-nic-grace", "1",
                 "--taint-precheck-report", str(report), "--taint-health-interval", "0.5",
                 "-v"],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:

            def ours() -> list:
                node = kube.node(name)
                return [t for t in node.spec.taints or [] if t.key == TAINT_KEY]

            # The peer is down: no carrier on our end, for longer than the grace.
            taints = _until("the NicNoCarrier taint", ours, log)
            assert [(t.value, t.effect) for t in taints] == [("NicNoCarrier", "NoSchedule")]
            node = kube.node(name)
            record = json.loads(node.metadata.annotations[RECORD_ANNOTATION])
            assert record["evidence"] == [f"NIC without carrier ({nic.host}: no carrier)"]
            assert record["job"] == "llm"

            # The condition is the node's status, patched apart from the taint: waited for too.
            def conditions() -> list:
                status = kube.node(name).status
                found = (status.conditions if status is not None else None) or []
                return [c for c in found if c.type == CONDITION_TYPE]

            (cond,) = _until("the node condition", conditions, log)
            assert cond.status == "True" and cond.reason == "NicNoCarrier"
            # The event follows the taint (posted after the node's patch): waited for, then one.
            events = _until("the DiagTainted event", lambda: kube.events_for(name), log)
            assert [e.reason for e in events] == ["DiagTainted"]

            # A real precheck on this node finds the same NIC: faulty. The agent adds it.
            r = _precheck(nic.host, report, tmp_path)
            assert r.returncode != 0 and "has no carrier" in r.stdout, r.stdout + r.stderr

            def updated() -> list:
                return [e for e in kube.events_for(name) if e.reason == "DiagTaintUpdated"]

            _until("the update with the precheck's verdict", updated, log)
            record = json.loads(kube.node(name).metadata.annotations[RECORD_ANNOTATION])
            # The precheck's view of the NIC and the monitor's are one fault, one line.
            nic_line, precheck_line = sorted(record["evidence"])
            assert nic_line == f"NIC without carrier ({nic.host}: no carrier)"
            assert precheck_line.startswith(
                f"precheck: faulty (interface {nic.host} has no carrier"
            )
            assert len(ours()) == 1

            # The link comes back and a clean precheck is written: the taint goes.
            nic.peer_link("up")
            r = _precheck(nic.host, report, tmp_path)
            assert r.returncode == 0, r.stdout + r.stderr
            _until("the untaint", lambda: not ours(), log)
            node = kube.node(name)
            cond = next(c for c in node.status.conditions if c.type == CONDITION_TYPE)
            assert cond.status == "False" and cond.reason == "PrecheckClean"
            assert RECORD_ANNOTATION not in (node.metadata.annotations or {})
            assert sorted(e.reason for e in kube.events_for(name)) == [
                "DiagTaintUpdated",
                "DiagTainted",
                "DiagUntainted",
            ]
            assert not kube.node(bystander).spec.taints and not kube.events_for(bystander)
        finally:
            terminate(agent, timeout=30)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
    # No GPU here: the NVML monitor skipped cleanly and said so.
    assert "GPU health not watched" in text or "watching" in text
