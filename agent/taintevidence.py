"""Where taint evidence comes from, read into `Evidence` for the planner:

- a precheck report (`diag precheck --report`): this node's verdict, its GPUs' ECC/XID findings
  and its NIC's carrier;
- the incident directories under the timeline path whose verdict blames one of this node's own
  ranks (its stack dump is in this node's incident directory);
- the job verdicts under `<timeline>/.jobs/` that name this node as the culprit's: the job
  verdict names a rank its own node did not blame (that node's agent saw a deadlock in which no
  rank stood out, or only ranks waiting for other nodes);
- the link state of named interfaces (`nodehealth.py` watches them in the agent) and the GPUs
  (`gpuhealth.py`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from diag.agent.exitcodes import UsageError
from diag.agent.incident import VERDICT_FILE, incident_id_of
from diag.agent.jobverdict import JobVerdict, JobVerdictStore
from diag.agent.precheck.evidence import DeviceHealth, NicState, Severity
from diag.agent.precheck.report import PrecheckReport
from diag.agent.taints import Evidence, Signal

log = logging.getLogger(__name__)

JOB_VERDICTS_DIR = ".jobs"  # under the timeline: the agent's JobVerdictStore (daemon.py)


def from_precheck_report(path: Path, node: str, flag: str = "--precheck-report") -> list[Evidence]:
    """This node's part of a precheck report: the copy a node writes has `reported_by` = its
    rank; the node's entry is also found by host name when the report came from elsewhere.
    Raises UsageError, naming `flag`, on a file that is missing or not a report."""
    try:
        report = PrecheckReport.from_dict(json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise UsageError(f"{flag} {path}: no such file") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{flag} {path}: not a diag precheck report ({e}); pass the file "
            "`diag precheck --report` wrote"
        ) from e
    entry = next((n for n in report.nodes if n.host == node), None) or report.node(
        report.reported_by
    )
    if entry is None:
        raise UsageError(f"{flag} {path}: no entry for node {node}")
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
            f"{n.iface}: no carrier",
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


def from_timeline(timeline: Path, node: str, since: float) -> list[Evidence]:
    """One CULPRIT per incident (by id) since `since` whose verdict, written on `node`, blames
    one of `node`'s own ranks."""
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
    """The verdict was written on `node` and the rank it blames is one it dumped (runs there)."""
    if doc.get("node") != node:
        return False
    try:
        rank = int(doc["culprit"])
    except (TypeError, ValueError):
        return False
    return any(incident_dir.glob(f"{rank:05d}-*.stack.json"))


def from_job_verdict(
    verdict: JobVerdict, job: str, node: str, at: float, incident_path: str
) -> Evidence | None:
    """A CULPRIT against `node` when the job verdict names it as the culprit's node; its id is
    the one the nodes' incident directories carry, so it counts once with them."""
    if verdict.culprit is None or verdict.culprit_node != node:
        return None
    return Evidence(
        Signal.CULPRIT,
        at,
        f"rank {verdict.culprit}: named by the job verdict",
        incident_id=incident_id_of(job, verdict.incident_id),
        incident_path=incident_path,
    )


def from_job_verdicts(timeline: Path, node: str, since: float) -> list[Evidence]:
    """One CULPRIT per job verdict under `<timeline>/.jobs/<job>/` decided since `since` (by
    its directory's time) that names `node`; the evidence path is the job verdict's directory.
    The job is the directory's name (a job's name with only the characters file names take)."""
    root = timeline / JOB_VERDICTS_DIR
    store = JobVerdictStore(root)
    out = []
    for incident_dir in sorted(root.glob("*/*")):
        job, incident = incident_dir.parent.name, incident_dir.name
        if job.startswith(".") or incident.startswith("."):
            continue
        try:
            at = incident_dir.stat().st_mtime
            if at < since:
                continue
            verdict = store.load(job, incident)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.debug("skipping the job verdict in %s: %s", incident_dir, e)
            continue
        if verdict is None:
            continue
        ev = from_job_verdict(verdict, job, node, at, str(incident_dir))
        if ev is not None:
            out.append(ev)
    return out


def culprit_history(timeline: Path, node: str, since: float) -> list[Evidence]:
    """Every incident since `since` that names `node`'s rank, from its own incident directories
    and from the job verdicts, one piece of evidence per incident (its own directory first)."""
    out: dict[str, Evidence] = {}
    for ev in [*from_timeline(timeline, node, since), *from_job_verdicts(timeline, node, since)]:
        out.setdefault(ev.incident_id, ev)
    return sorted(out.values(), key=lambda e: e.at)
