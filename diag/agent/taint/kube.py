"""Kubernetes adapter for node taints: read the node, apply a `TaintPlan`, post its Event.

The node's taints and the evidence annotation go in one JSON merge patch that carries the
`resourceVersion` it was planned from: if another writer (a second agent, the kubelet, an admin)
changed the node meanwhile, the API server answers 409 Conflict and we read again, plan again and
retry. The condition goes to the `nodes/status` subresource as a strategic-merge patch of our
condition alone (merged by `type`, so the kubelet's conditions are left as they are).

The real `kubernetes` client is imported here only, when a taint command or the agent's taint
step runs; tests point it at an in-memory API server (or a real cluster through KUBECONFIG).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diag.agent.taint.planner import (
    DOMAIN,
    RECORD_ANNOTATION,
    TAINT_KEY,
    Action,
    Condition,
    NodeEvent,
    NodeView,
    Taint,
    TaintPlan,
    TaintRecord,
)
from diag.formats.exitcodes import UsageError

log = logging.getLogger(__name__)

EVENT_SOURCE = "diag-agent"
INCIDENT_ANNOTATION = f"{DOMAIN}/incident-id"
INCIDENT_PATH_ANNOTATION = f"{DOMAIN}/incident-path"


class KubeError(Exception):
    """The API server refused or could not be reached; the message says which and why."""


@dataclass(frozen=True)
class NodeState:
    view: NodeView
    resource_version: str
    uid: str
    record_error: str = ""  # our annotation was there but unreadable


@dataclass(frozen=True)
class ApplyResult:
    plan: TaintPlan
    attempts: int  # node patches tried (1 + the conflicts retried)
    applied: bool
    event_name: str = ""


def connect(kubeconfig: str | None = None) -> Any:
    """A CoreV1Api: from `kubeconfig` (or $KUBECONFIG) when given, else the in-cluster account."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError as e:
        raise UsageError(
            "node tainting needs the kubernetes client: pip install 'diag[k8s]'"
        ) from e
    path = kubeconfig or os.environ.get("KUBECONFIG")
    try:
        if path:
            api_client = config.new_client_from_config(config_file=path)
        else:
            config.load_incluster_config()
            api_client = client.ApiClient()
    except (ConfigException, OSError) as e:
        where = f"kubeconfig {path}" if path else "the in-cluster service account"
        raise UsageError(
            f"cannot configure the Kubernetes client from {where}: {e}. Run inside a pod with "
            "the diag-agent service account, or set KUBECONFIG / --kubeconfig"
        ) from e
    return client.CoreV1Api(api_client)


def read_node(api: Any, name: str) -> NodeState:
    node = _call(lambda: api.read_node(name), f"read node {name}")
    meta, spec, status = node.metadata, node.spec, node.status
    taints = tuple(
        Taint(
            key=t.key,
            effect=t.effect,
            value=t.value or "",
            time_added=_iso(t.time_added) if t.time_added else None,
        )
        for t in (spec.taints if spec is not None and spec.taints else [])
    )
    conditions = tuple(
        Condition(
            type=c.type,
            status=c.status,
            reason=c.reason or "",
            message=c.message or "",
            last_transition=_unix(c.last_transition_time),
            last_heartbeat=_unix(c.last_heartbeat_time),
        )
        for c in (status.conditions if status is not None and status.conditions else [])
    )
    record, record_error = None, ""
    raw = (meta.annotations or {}).get(RECORD_ANNOTATION)
    if raw:
        try:
            record = TaintRecord.from_json(raw)
        except ValueError as e:
            record_error = str(e)
    return NodeState(
        view=NodeView(name=name, taints=taints, conditions=conditions, record=record),
        resource_version=meta.resource_version or "",
        uid=meta.uid or "",
        record_error=record_error,
    )


def nodes_with_diag_taint(api: Any) -> list[str]:
    """Names of the nodes that carry diag's taint or its record (needs `list` on nodes)."""
    items = _call(lambda: api.list_node().items, "list nodes")
    out = []
    for n in items:
        taints = n.spec.taints if n.spec is not None and n.spec.taints else []
        annotations = n.metadata.annotations or {}
        if any(t.key == TAINT_KEY for t in taints) or RECORD_ANNOTATION in annotations:
            out.append(n.metadata.name)
    return sorted(out)


def apply_plan(
    api: Any,
    name: str,
    decide: Callable[[NodeView], TaintPlan],
    *,
    event_namespace: str = "default",
    retries: int = 5,
    on_attempt: Callable[[int], None] | None = None,
) -> ApplyResult:
    """Read the node, plan with `decide`, write; on a conflict read, plan and write again.

    `decide` is called once per attempt with the node as it is then, so a concurrent writer's
    change is planned from, never overwritten.
    """
    from kubernetes.client.exceptions import ApiException

    attempts = 0
    while True:
        state = read_node(api, name)
        plan = decide(state.view)
        if not plan.changes_node:
            return ApplyResult(plan, attempts, applied=False)
        attempts += 1
        if on_attempt is not None:
            on_attempt(attempts)
        body = node_patch(plan, state.resource_version)
        if body is None:
            break  # a blocked plan changes the condition only
        try:
            api.patch_node(name, body, _content_type="application/merge-patch+json")
            break
        except ApiException as e:
            if e.status == 409 and attempts <= retries:
                log.info("node %s changed while we planned (attempt %d): retrying", name, attempts)
                time.sleep(min(0.05 * 2**attempts, 1.0))
                continue
            raise KubeError(_api_text(e, f"patch node {name}")) from e
        except Exception as e:  # urllib3 connection errors and the like
            raise KubeError(f"patch node {name}: {e}") from e
    status = status_patch(plan)
    if status is not None:
        _call(
            lambda: api.patch_node_status(
                name, status, _content_type="application/strategic-merge-patch+json"
            ),
            f"patch the condition of node {name}",
        )
    event_name = ""
    if plan.event is not None:
        event_name = post_event(api, name, state.uid, plan.event, event_namespace)
    return ApplyResult(plan, attempts, applied=True, event_name=event_name)


def post_event(api: Any, node: str, uid: str, event: NodeEvent, namespace: str) -> str:
    body = event_body(node, uid, event, namespace, time.time_ns())
    _call(lambda: api.create_namespaced_event(namespace, body), f"post an event for {node}")
    return str(body["metadata"]["name"])


def event_body(node: str, uid: str, event: NodeEvent, namespace: str, now_ns: int) -> dict:
    """The Event about `node`, as it is posted."""
    stamp = dt.datetime.fromtimestamp(now_ns / 1e9, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    # Named like the kubelet's events (object name + unique suffix): generateName needs the
    # server to pick the name, and the name must be known to find the event again.
    name = f"{node}.{now_ns:x}"
    annotations = {}
    if event.incident_id:
        annotations[INCIDENT_ANNOTATION] = event.incident_id
    if event.incident_path:
        annotations[INCIDENT_PATH_ANNOTATION] = event.incident_path
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid},
        "reason": event.reason,
        "message": event.message[:1024],
        "type": event.type,
        "source": {"component": EVENT_SOURCE, "host": node},
        "reportingComponent": f"{DOMAIN}/agent",
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def status_patch(plan: TaintPlan) -> dict[str, Any] | None:
    """The strategic-merge patch of `nodes/status` that sets diag's condition alone (merged by
    `type`: the kubelet's conditions stay as they are); None when the plan leaves it."""
    if plan.condition is None:
        return None
    return {"status": {"conditions": [_condition_body(plan.condition)]}}


def node_patch(plan: TaintPlan, resource_version: str) -> dict[str, Any] | None:
    """The JSON merge patch of the node: its whole taint list and diag's annotation, with the
    `resourceVersion` the plan was made from; None for a plan that changes the condition only."""
    if plan.action == Action.BLOCKED:
        return None
    annotations: dict[str, Any] = {}
    if plan.record is not None:
        annotations[RECORD_ANNOTATION] = plan.record.to_json()
    elif plan.clear_record:
        annotations[RECORD_ANNOTATION] = None  # merge patch: null removes the key
    meta: dict[str, Any] = {"resourceVersion": resource_version}
    if annotations:
        meta["annotations"] = annotations
    # The whole list: a merge patch replaces lists, and the resourceVersion makes sure it is
    # the list we planned from.
    taints = [_taint_body(t) for t in plan.taints]
    return {"metadata": meta, "spec": {"taints": taints or None}}


def _taint_body(t: Taint) -> dict[str, Any]:
    body: dict[str, Any] = {"key": t.key, "effect": t.effect}
    if t.value:
        body["value"] = t.value
    if t.time_added:
        body["timeAdded"] = t.time_added
    return body


def _condition_body(c: Condition) -> dict[str, Any]:
    return {
        "type": c.type,
        "status": c.status,
        "reason": c.reason,
        "message": c.message,
        "lastTransitionTime": _iso(c.last_transition),
        "lastHeartbeatTime": _iso(c.last_heartbeat),
    }


def _iso(value: Any) -> str:
    if isinstance(value, dt.datetime):
        when = value
    else:
        when = dt.datetime.fromtimestamp(float(value), dt.UTC)
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unix(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, dt.datetime):
        return value.timestamp()
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _call(fn: Callable[[], Any], what: str) -> Any:
    from kubernetes.client.exceptions import ApiException

    try:
        return fn()
    except ApiException as e:
        raise KubeError(_api_text(e, what)) from e
    except Exception as e:  # connection refused, DNS, TLS
        raise KubeError(f"{what}: {e}") from e


def _api_text(e: Any, what: str) -> str:
    hint = {
        401: "the credentials were refused",
        403: "forbidden: check the diag-agent ClusterRole and the admission policy "
        "(an agent may change only its own node)",
        404: "no such object",
        409: "the object kept changing; gave up after the retries",
    }.get(e.status, e.reason or "")
    return f"{what}: HTTP {e.status} {hint}".rstrip()
