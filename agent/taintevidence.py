"""Where taint evidence comes from, read into `Evidence` for the planner:

- a precheck report (`diag precheck --report`): this node's verdict, its GPUs' ECC/XID findings
  and its NIC's carrier;
- the incident directories under the timeline path that name this node's rank as the culprit
  (a rank is this node's when its stack dump is in this node's incident directory, or when the
  verdict names the culprit's node);
- NVML now: uncorrected ECC errors (volatile) and XID events seen while it looks;
- the link state of named interfaces.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from diag.agent.exitcodes import UsageError
from diag.agent.incident import VERDICT_FILE
from diag.agent.precheck.evidence import DeviceHealth, NicState, Severity
from diag.agent.precheck.report import PrecheckReport
from diag.agent.taints import Evidence, Signal

log = logging.getLogger(__name__)


def from_precheck_report(path: Path, node: str) -> list[Evidence]:
    """This node's part of a precheck report: the copy a node writes has `reported_by` = its
    rank; the node's entry is also found by host name when the report came from elsewhere."""
    try:
        report = PrecheckReport.from_dict(json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise UsageError(f"--precheck-report {path}: no such file") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"--precheck-report {path}: not a diag precheck report ({e}); pass the file "
            "`diag precheck --report` wrote"
        ) from e
    entry = next((n for n in report.nodes if n.host == node), None) or report.node(
        report.reported_by
    )
    if entry is None:
        raise UsageError(f"--precheck-report {path}: no entry for node {node}")
    at = report.started_at + report.wall_seconds
    where = str(path)
    out: list[Evidence] = []
    if entry.status == Severity.FAULTY:
        out.append(Evidence(Signal.PRECHECK_FAULTY, at, entry.reason, incident_path=where))
    elif entry.status == Severity.HEALTHY and report.error is None:
        out.append(Evidence(Signal.PRECHECK_HEALTHY, at, "precheck passed", incident_path=where))
    out += from_devices(entry.devices, at, where)
    if entry.nic is not None:
        out += from_nics([entry.nic], at, where)
    return out


def from_devices(devices: Iterable[DeviceHealth], at: float, where: str = "") -> list[Evidence]:
    out = []
    for d in devices:
        if d.ecc_uncorrected:
            out.append(
                Evidence(
                    Signal.GPU_ECC,
                    at,
                    f"GPU {d.index} {d.name}".strip(),
                    incident_path=where,
                    gpu=d.index,
                    count=int(d.ecc_uncorrected),
                )
            )
        for code in d.xid_errors:
            out.append(
                Evidence(Signal.GPU_XID, at, d.name, incident_path=where, gpu=d.index, xid=code)
            )
    return out


def from_nics(nics: Iterable[NicState], at: float, where: str = "") -> list[Evidence]:
    return [
        Evidence(
            Signal.NIC_NO_CARRIER,
            at,
            f"{n.iface}: operstate {n.operstate or '?'}",
            incident_path=where,
        )
        for n in nics
        if n.carrier is False
    ]


def probe_nics(ifaces: Sequence[str], now: float) -> list[Evidence]:
    from diag.agent.precheck.nic import addr_of, link_state

    states = []
    for name in ifaces:
        state = link_state(name, addr_of(name))
        if state.error:
            raise UsageError(f"--iface {name}: {state.error}")
        states.append(state)
    return from_nics(states, now)


def probe_gpus(now: float) -> tuple[list[Evidence], str | None]:
    """ECC and XIDs from NVML now; the note says why nothing was read (no driver)."""
    from diag.agent.precheck.devicehealth import NvmlWatch

    watch = NvmlWatch()
    watch.start()
    devices = watch.finish()
    return from_devices(devices, now, "nvml"), watch.note


def from_timeline(timeline: Path, node: str, since: float) -> list[Evidence]:
    """One CULPRIT per incident (by id) since `since` whose culprit rank ran on `node`."""
    out: dict[str, Evidence] = {}
    if not timeline.is_dir():
        return []
    for path in timeline.glob(f"*/{VERDICT_FILE}"):
        if path.parent.name.startswith("."):
            continue
        try:
            mtime = path.stat().st_mtime
            if mtime < since:
                continue
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.debug("skipping %s: %s", path, e)
            continue
        if not isinstance(doc, dict) or doc.get("culprit") is None:
            continue
        if not _culprit_here(doc, path.parent, node):
            continue
        incident = str(doc.get("incident_id") or path.parent.name)
        if incident in out:
            continue
        out[incident] = Evidence(
            Signal.CULPRIT,
            mtime,
            f"rank {doc['culprit']}: {str(doc.get('summary', ''))[:200]}",
            incident_id=incident,
            incident_path=str(path.parent),
        )
    return sorted(out.values(), key=lambda e: e.at)


def _culprit_here(doc: dict, incident_dir: Path, node: str) -> bool:
    culprit_node = doc.get("culprit_node")
    if culprit_node is not None:
        return str(culprit_node) == node
    if doc.get("node") != node:
        return False
    try:
        rank = int(doc["culprit"])
    except (TypeError, ValueError):
        return False
    return any(incident_dir.glob(f"{rank:05d}-*.stack.json"))


def now() -> float:
    return time.time()
