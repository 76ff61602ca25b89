"""A ValidatingAdmissionPolicy evaluated by a real CEL evaluator (cel-python) the way the API
server does: match conditions, then the variables in order (each sees the ones before it), then
every validation; an evaluation error denies (failurePolicy: Fail). And the two patch types the
agent and `diag untaint` send, applied as the API server applies them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import yaml

NODE_KEY = "authentication.kubernetes.io/node-name"


def load_policies(path: Path) -> dict[str, dict]:
    """The policies of a manifest file, each with its Deny binding."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    pols = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert {b["spec"]["policyName"] for b in bindings} == set(pols)
    assert all(b["spec"]["validationActions"] == ["Deny"] for b in bindings)
    return pols


ENV = celpy.Environment()


def _eval(expr: str, activation: dict[str, Any]) -> Any:
    prog = ENV.program(ENV.compile(expr))
    out = prog.evaluate(activation)
    if isinstance(out, celpy.CELEvalError):
        raise out
    return out


def admit(
    policy: dict, obj: dict, old: dict | None, user: str, node: str | None, sub: str = ""
) -> tuple[bool, list[str]]:
    """(allowed, messages). Not matched: allowed."""
    extra = {NODE_KEY: [node]} if node is not None else {}
    request = {
        "userInfo": {"username": user, "extra": extra},
        "subResource": sub,
        "operation": "UPDATE" if old is not None else "CREATE",
    }
    act: dict[str, Any] = {
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel(request),
    }
    spec = policy["spec"]
    for cond in spec.get("matchConditions", []):
        if not _eval(cond["expression"], act):
            return True, []
    variables: dict[str, Any] = {}
    for var in [*spec.get("variables", []), None]:
        act["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()}
        )
        if var is not None:
            variables[var["name"]] = _eval(var["expression"], act)
    denied = []
    for v in spec["validations"]:
        try:
            ok = bool(_eval(v["expression"], act))
        except celpy.CELEvalError as e:
            denied.append(f"evaluation error: {e}")
            continue
        if not ok:
            msg = v.get("message") or str(_eval(v["messageExpression"], act))
            denied.append(msg)
    return not denied, denied


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def status_merge(node: dict, patch: dict) -> dict:
    """A strategic-merge patch of `status.conditions`, merged by `type` (the list's patch merge
    key), as the API server applies the agent's condition patch."""
    out = copy.deepcopy(node)
    merged = {c["type"]: c for c in out.setdefault("status", {}).get("conditions", [])}
    for c in patch["status"]["conditions"]:
        merged[c["type"]] = {**merged.get(c["type"], {}), **c}
    out["status"]["conditions"] = list(merged.values())
    return out
