"""The Kubernetes API the k8s tests talk to: a real cluster when KUBECONFIG is set (the tests
then create and delete their own Node objects, named diag-test-*), else the in-memory API server
of tests/support/cluster/kubesim.py, started as its own process with a kubeconfig that points at it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass
class Cluster:
    kubeconfig: str
    real: bool
    api: Any
    prefix: str = field(default_factory=lambda: f"diag-test-{uuid.uuid4().hex[:6]}")
    created: list[str] = field(default_factory=list)

    def node_name(self, short: str) -> str:
        return f"{self.prefix}-{short}"

    def create_node(self, short: str, taints=(), conditions=None) -> str:
        name = self.node_name(short)
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"diag.dev/test": self.prefix}},
            "spec": {"taints": [dict(t) for t in taints]} if taints else {},
        }
        self.api.create_node(body)
        self.created.append(name)
        if conditions:
            self.api.patch_node_status(
                name,
                {"status": {"conditions": conditions}},
                _content_type="application/strategic-merge-patch+json",
            )
        return name

    def node(self, name: str) -> Any:
        return self.api.read_node(name)

    def events_for(self, node: str, namespace: str = "default") -> list[Any]:
        """diag's Events about `node` (a real cluster's controllers post their own too)."""
        items = self.api.list_namespaced_event(namespace).items
        return [
            e
            for e in items
            if e.involved_object and e.involved_object.name == node and e.reason.startswith("Diag")
        ]

    def cleanup(self) -> None:
        from kubernetes.client.exceptions import ApiException

        for name in self.created:
            for ev in self.events_for(name):
                with suppress(ApiException):
                    self.api.delete_namespaced_event(ev.metadata.name, ev.metadata.namespace)
            with suppress(ApiException):
                self.api.delete_node(name)


def _client(kubeconfig: str) -> Any:
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))


@contextmanager
def cluster(tmp: Path) -> Iterator[Cluster]:
    real = os.environ.get("KUBECONFIG")
    if real:
        c = Cluster(real, True, _client(real))
        try:
            yield c
        finally:
            c.cleanup()
        return
    portfile = tmp / "kubesim.port"
    log = open(tmp / "kubesim.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "kubesim.py"), str(portfile)], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 60
        while not portfile.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kubesim did not start: {(tmp / 'kubesim.log').read_text()}")
            time.sleep(0.05)
        port = int(portfile.read_text())
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: sim, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
            "users: [{name: sim, user: {token: test}}]\n"
            "contexts: [{name: sim, context: {cluster: sim, user: sim}}]\n"
            "current-context: sim\n"
        )
        yield Cluster(str(kubeconfig), False, _client(str(kubeconfig)))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
