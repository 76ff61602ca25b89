"""Where taint evidence comes from, read into `Evidence` for the planner:

- a precheck report (`diag precheck --report`): this node's verdict, its GPUs' ECC/XID findings
  and its NIC's carrier;
- the incident directories under the timeline path whose verdict blames one of this node's own
  ranks (its stack dump is in this node's incident directory);
- the job verdicts under `<timeline>/.jobs/` that name this node as the culprit's: the job
  verdict names a rank its own node did not blame (that node's agent saw a deadlock in which no
  rank stood out, or only ranks waiting for other nodes);
- the link state of named interfaces (`health/monitors.py` watches them in the agent) and the GPUs
  (`gpuhealth.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from diag.agent.job.files import SUMMARY
from diag.agent.job.nodeview import MAX_RANKS
from diag.agent.job.verdict import JobVerdict, JobVerdictStore
from diag.agent.node.linkstate import NicState
from diag.agent.precheck.measurements import DeviceHealth, Severity
from diag.agent.precheck.report import read_report
from diag.agent.taint.planner import Evidence, Signal
from diag.formats.checkedjson import NAME, Fields
from diag.formats.exitcodes import UsageError
from diag.formats.incidentdir import VERDICT_FILE, incident_id_of
from diag.formats.untrusted import MIB, UntrustedInput, read_json

log = logging.getLogger(__name__)

JOB_VERDICTS_DIR = ".jobs"  # under the timeline: the agent's JobVerdictStore (daemon.py)
MAX_VERDICT_BYTES = 16 * MIB  # an incident's verdict.json: a few KiB
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def from_precheck_report(path: Path, node: str, flag: str = "--precheck-report") -> list[Evidence]:
    """This node's part of a precheck report: the copy a node writes has `reported_by` = its
    rank; the node's entry is also found by host name when the report came from elsewhere.
    Raises UsageError, naming `flag`, on a file that is missing or not a report."""
    if not os.path.lexists(path):
        raise UsageError(f"{flag} {path}: no such file")
    try:
        report = read_report(path)
    except UntrustedInput as e:
        raise UsageError(
            f"{flag} {path}: not a diag precheck report ({e.problem}); pass the file "
            "`diag precheck --report` wrote"
        ) from None
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
    from diag.agent.node.nic import addr_of, link_state

    states = []
    for name in ifaces:
        state = link_state(name, addr_of(name))
        if state.error:
            raise UsageError(f"--iface {name}: {state.error}")
        states.append(state)
    return from_nics(states, now)


@contextlib.contextmanager
def _dirs(base: Path, pattern: str = "") -> Iterator[Iterator[tuple[str, int]]]:
    """(name, descriptor) of each directory in `base` but hidden ones, opened without
    following a symlink (one planted in the timeline leads nowhere)."""
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield iter(())
        return

    def each() -> Iterator[tuple[str, int]]:
        for name in sorted(os.listdir(base_fd)):
            if name.startswith("."):
                continue
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
            except OSError:
                continue  # a file, a symlink, or gone
            try:
                yield name, fd
            finally:
                os.close(fd)

    try:
        yield each()
    finally:
        os.close(base_fd)


def _verdict_doc(fd: int, path: Path, since: float) -> tuple[float, Fields] | None:
    """An incident's verdict.json made since `since`, or None (a bad one with a warning)."""
    try:
        mtime = os.stat(VERDICT_FILE, dir_fd=fd, follow_symlinks=False).st_mtime
    except OSError:
        return None
    if mtime < since:
        return None
    try:
        return mtime, Fields(
            read_json(VERDICT_FILE, max_bytes=MAX_VERDICT_BYTES, dir_fd=fd), str(path)
        )
    except UntrustedInput as e:
        log.warning("skipping %s: %s", path, e.problem)
        return None


def from_timeline(timeline: Path, node: str, since: float) -> list[Evidence]:
    """One CULPRIT per incident (by id) since `since` whose verdict, written on `node`, blames
    one of `node`'s own ranks."""
    out: dict[str, Evidence] = {}
    with _dirs(timeline) as dirs:
        for name, fd in dirs:
            path = timeline / name / VERDICT_FILE
            found = _verdict_doc(fd, path, since)
            if found is None:
                continue
            mtime, doc = found
            try:
                if doc.d.get("culprit") is None or doc.d.get("node") != node:
                    continue
                rank = doc.int("culprit", 0, MAX_RANKS - 1)
                incident = doc.str("incident_id", "") or name
                summary = doc.str("summary", "", SUMMARY)
            except UntrustedInput as e:
                log.warning("skipping %s: %s", path, e.problem)
                continue
            if incident in out or not _dumped(fd, rank):
                continue
            out[incident] = Evidence(
                Signal.CULPRIT,
                mtime,
                f"rank {rank}: {summary[:200]}",
                incident_id=incident[:NAME],
                incident_path=str(path.parent),
            )
    return sorted(out.values(), key=lambda e: e.at)


def _dumped(fd: int, rank: int) -> bool:
    """The rank the verdict blames has its stack dump in the directory (it runs here)."""
    prefix = f"{rank:05d}-"
    return any(n.startswith(prefix) and n.endswith(".stack.json") for n in os.listdir(fd))


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


def _job_verdicts(timeline: Path, since: float) -> Iterator[tuple[JobVerdict, str, float, str]]:
    """(verdict, job, its directory's time, its directory) of each job verdict under
    `<timeline>/.jobs/<job>/` decided since `since`. The job is the directory's name (a job's
    name with only the characters file names take)."""
    root = timeline / JOB_VERDICTS_DIR
    store = JobVerdictStore(root)
    with _dirs(root) as jobs:
        for job, _ in jobs:
            with _dirs(root / job) as incidents:
                for incident, fd in incidents:
                    at = os.fstat(fd).st_mtime
                    if at < since:
                        continue
                    try:
                        verdict = store.load(job, incident)
                    except (OSError, UntrustedInput) as e:
                        log.warning("skipping the job verdict in %s: %s", root / job / incident, e)
                        continue
                    if verdict is not None:
                        yield verdict, job, at, str(root / job / incident)


def from_job_verdicts(timeline: Path, node: str, since: float) -> list[Evidence]:
    """One CULPRIT per job verdict decided since `since` (by its directory's time) that names
    `node`; the evidence path is the job verdict's directory."""
    out = []
    for verdict, job, at, where in _job_verdicts(timeline, since):
        ev = from_job_verdict(verdict, job, node, at, where)
        if ev is not None:
            out.append(ev)
    return out


def a_victim(verdict: JobVerdict, node: str) -> bool:
    """The job verdict blames a node that went silent, not `node`: a rank of `node` that died
    then died because its peer vanished, whatever `node`'s own verdict said."""
    return bool(verdict.lost_nodes) and verdict.culprit_node != node


def culprit_history(timeline: Path, node: str, since: float) -> list[Evidence]:
    """Every incident since `since` that names `node`'s rank, from its own incident directories
    and from the job verdicts, one piece of evidence per incident (its own directory first);
    not an incident whose job verdict names a lost node instead (`a_victim`)."""
    verdicts = list(_job_verdicts(timeline, since))
    spared = {incident_id_of(job, v.incident_id) for v, job, _, _ in verdicts if a_victim(v, node)}
    own = [ev for ev in from_timeline(timeline, node, since) if ev.incident_id not in spared]
    named = [from_job_verdict(v, job, node, at, where) for v, job, at, where in verdicts]
    out: dict[str, Evidence] = {}
    for ev in [*own, *(ev for ev in named if ev is not None)]:
        out.setdefault(ev.incident_id, ev)
    return sorted(out.values(), key=lambda e: e.at)
