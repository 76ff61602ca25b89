"""One verdict per incident for the whole job, agreed through the shared timeline volume.

Every agent that raised an incident files one report for it, and nothing in steady state:

    <timeline>/.jobs/<job>/<incident id>/
        reports/<report name>     one per node that saw the incident (its own evidence directory)
        claim                     created with O_CREAT|O_EXCL: its creator assembles the verdict
        job-verdict.json          the job's verdict, put in place by link(2), so there is one

A report's *name* carries what the verdict needs from it (the rank it blames, whether that rank
runs on the reporting node, and the node), so the agent that holds the claim learns every node's
opinion from one directory listing and reads the contents of the reports from the culprit's node
only. When no node blames one of its own ranks (the culprit's node saw nothing, or its agent is
gone), the claimant reads every report once and runs the culprit analysis over the views of the
ranks they carry (`nodeview.py`), as if one agent watched the whole job. The filesystem's
exclusive create is the only arbitration: no home-made consensus.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.agent.nodeview import analyse
from diag.collector.meta import safe_job_name, write_atomic

if TYPE_CHECKING:
    from diag.agent.actions import IncidentReport

log = logging.getLogger(__name__)

JOB_VERDICT_FORMAT = "diag.job-verdict/1"
JOB_VERDICT_FILE = "job-verdict.json"
CLAIM_FILE = "claim"
REPORTS_DIR = "reports"


class Where(enum.Enum):
    LOCAL = "L"  # the blamed rank runs on the reporting node: that node knows it first-hand
    REMOTE = "R"  # the blamed rank runs elsewhere (or the report blames nobody)


@dataclass(frozen=True)
class NodeReport:
    """One node's view of one incident."""

    node: str
    culprit: int | None
    where: Where
    evidence: str  # the node's incident directory
    kind: str = ""
    summary: str = ""
    wall: float = 0.0  # when the node filed it (its clock)
    view: dict[str, Any] | None = None  # its ranks at the verdict (nodeview.view_document)

    def name(self) -> str:
        rank = "x" if self.culprit is None else str(self.culprit)
        # The evidence directory's own name rides along, so one listing gives every node's.
        evidence = _safe(Path(self.evidence).name)
        return f"r{rank}.{self.where.value}.{_safe(self.node)[:63]}~{evidence}"


@dataclass(frozen=True)
class ReportName:
    """What a report's file name says, without reading it."""

    node: str
    culprit: int | None
    where: Where
    file: str
    evidence_name: str = ""


_NAME = re.compile(r"^r(x|\d+)\.([LR])\.([A-Za-z0-9_.-]+)~([A-Za-z0-9_.-]*)$")


def parse_name(name: str) -> ReportName | None:
    m = _NAME.match(name)
    if m is None:
        return None
    rank = None if m.group(1) == "x" else int(m.group(1))
    return ReportName(
        node=m.group(3), culprit=rank, where=Where(m.group(2)), file=name, evidence_name=m.group(4)
    )


@dataclass(frozen=True)
class JobVerdict:
    incident_id: str
    job: str
    culprit: int | None
    culprit_node: str  # "" when no node reported the culprit as its own
    basis: str  # why this rank: first-hand, or the most nodes' opinion
    nodes: tuple[str, ...]
    evidence: tuple[str, ...]  # the incident directories of every node that reported
    first_hand: NodeReport | None
    decided_wall: float


def ready(names: list[ReportName], first_seen: float, now: float, settle: float) -> bool:
    """The verdict can be assembled once a node has reported the culprit as its own rank, or
    `settle` seconds after the first report (a culprit whose node saw nothing)."""
    return any(n.where == Where.LOCAL and n.culprit is not None for n in names) or (
        now - first_seen >= settle
    )


def pick_culprit(names: list[ReportName]) -> tuple[int | None, str, str]:
    """(rank, node, basis). A node that blames one of its own ranks knows it first-hand (it saw
    the rank die or sit outside the collective); otherwise the rank most nodes blame."""
    local = Counter(n.culprit for n in names if n.where == Where.LOCAL and n.culprit is not None)
    if local:
        rank, _ = max(local.items(), key=lambda kv: (kv[1], -kv[0]))
        node = min(n.node for n in names if n.where == Where.LOCAL and n.culprit == rank)
        return rank, node, "first-hand: the culprit's own node blamed it"
    blamed = Counter(n.culprit for n in names if n.culprit is not None)
    if not blamed:
        return None, "", "no node named a single culprit"
    rank, votes = max(blamed.items(), key=lambda kv: (kv[1], -kv[0]))
    return rank, "", f"named by {votes} of {len(names)} nodes; its own node did not report"


def assemble(
    incident_id: str,
    job: str,
    names: list[ReportName],
    read: dict[str, NodeReport],
    evidence: dict[str, str],
    now_wall: float,
    pick: tuple[int | None, str, str] | None = None,
) -> JobVerdict:
    rank, node, basis = pick if pick is not None else pick_culprit(names)
    first = None
    for n in names:
        if n.node == node and n.culprit == rank and n.file in read:
            first = replace(read[n.file], view=None)  # the verdict stays small
            break
    nodes = tuple(sorted({n.node for n in names}))
    return JobVerdict(
        incident_id=incident_id,
        job=job,
        culprit=rank,
        culprit_node=node,
        basis=basis,
        nodes=nodes,
        evidence=tuple(evidence[n.file] for n in sorted(names, key=lambda n: n.node)),
        first_hand=first,
        decided_wall=now_wall,
    )


def _from_views(reports: list[NodeReport], now_wall: float) -> tuple[int, str, str] | None:
    """(rank, node, basis) from the culprit analysis over every report's view; None when the
    views name no single rank."""
    views = [r.view for r in reports if r.view is not None]
    a = analyse(views, now_wall)
    if a.culprit is None:
        return None
    return a.culprit, a.node, f"from the views of {len(views)} nodes: {a.reason}"


def _verdict_bytes(verdict: JobVerdict) -> bytes:
    doc = {"format": JOB_VERDICT_FORMAT, **asdict(verdict)}
    if verdict.first_hand is not None:
        doc["first_hand"]["where"] = verdict.first_hand.where.value
    return json.dumps(doc, indent=1).encode()


def _safe(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", node)[:100] or "node"


@dataclass
class IOCount:
    writes: int = 0
    reads: int = 0
    listings: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class JobVerdictStore:
    """The file adapter: `<root>/<job>/<incident id>/` on the shared timeline volume."""

    def __init__(self, root: Path, *, settle: float = 10.0, poll: float = 0.5) -> None:
        self.root = root
        self.settle = settle
        self.poll = poll
        self.io = IOCount()

    def incident_dir(self, job: str, incident_id: str) -> Path:
        return self.root / safe_job_name(job or "job") / _safe(incident_id)

    def file(self, job: str, incident_id: str, report: NodeReport) -> bool:
        """Files this node's report; True when this node holds the claim (and so assembles)."""
        d = self.incident_dir(job, incident_id)
        (d / REPORTS_DIR).mkdir(parents=True, exist_ok=True)
        data = json.dumps({**asdict(report), "where": report.where.value}).encode()
        write_atomic(d / REPORTS_DIR / report.name(), data)
        self.io.writes += 1
        self.io.bytes_written += len(data)
        try:
            fd = os.open(d / CLAIM_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(report.node)
        self.io.writes += 1
        return True

    def names(self, job: str, incident_id: str) -> list[ReportName]:
        d = self.incident_dir(job, incident_id) / REPORTS_DIR
        self.io.listings += 1
        try:
            entries = os.listdir(d)
        except FileNotFoundError:
            return []
        self.io.bytes_read += sum(len(e) for e in entries)  # the names are the listing's payload
        return [n for n in map(parse_name, entries) if n is not None]

    def _read(self, path: Path) -> NodeReport | None:
        try:
            raw = path.read_bytes()
            doc = json.loads(raw)
            self.io.reads += 1
            self.io.bytes_read += len(raw)
            return NodeReport(**{**doc, "where": Where(doc["where"])})
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("ignoring the unreadable report %s: %s", path, e)
            return None

    def conclude(
        self, job: str, incident_id: str, *, first_seen: float, now_wall: float, force: bool
    ) -> JobVerdict | None:
        """One attempt: lists the reports, and when `ready` (or `force`) reads the culprit
        node's reports only and puts the job verdict in place (once: link(2) refuses a second)."""
        names = self.names(job, incident_id)
        if not names or not (force or ready(names, first_seen, now_wall, self.settle)):
            return None
        d = self.incident_dir(job, incident_id)
        pick = pick_culprit(names)
        rank, node, _ = pick
        first_hand = any(n.where == Where.LOCAL and n.culprit is not None for n in names)
        read: dict[str, NodeReport] = {}
        for n in names:
            if (node and n.node == node and n.culprit == rank) or not first_hand:
                r = self._read(d / REPORTS_DIR / n.file)
                if r is not None:
                    read[n.file] = r
        if not first_hand:
            pick = _from_views(list(read.values()), now_wall) or pick
        # Evidence directories sit in the timeline, named in each report's name.
        timeline = self.root.parent
        evidence = {
            n.file: (read[n.file].evidence if n.file in read else str(timeline / n.evidence_name))
            for n in names
        }
        verdict = assemble(incident_id, job, names, read, evidence, now_wall, pick)
        self.publish(d, verdict)
        return self.load(job, incident_id)

    def publish(self, d: Path, verdict: JobVerdict) -> None:
        data = _verdict_bytes(verdict)
        tmp = d / f".{JOB_VERDICT_FILE}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        try:
            os.link(tmp, d / JOB_VERDICT_FILE)
            self.io.writes += 1
            self.io.bytes_written += len(data)
        except FileExistsError:
            pass  # another agent concluded first: theirs stands
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def load(self, job: str, incident_id: str) -> JobVerdict | None:
        path = self.incident_dir(job, incident_id) / JOB_VERDICT_FILE
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        fh = doc.get("first_hand")
        return JobVerdict(
            incident_id=doc["incident_id"],
            job=doc["job"],
            culprit=doc["culprit"],
            culprit_node=doc["culprit_node"],
            basis=doc["basis"],
            nodes=tuple(doc["nodes"]),
            evidence=tuple(doc["evidence"]),
            first_hand=NodeReport(**{**fh, "where": Where(fh["where"])}) if fh else None,
            decided_wall=doc["decided_wall"],
        )

    def wait_and_conclude(self, job: str, incident_id: str, first_seen: float) -> JobVerdict | None:
        """The claimant's loop: one listing per `poll` seconds until ready, at most `settle`.
        A verdict reached early (the culprit's node reported) gets the evidence of the nodes
        that report later added once, at the end of the settle time; its culprit stays."""
        while True:
            now = time.time()
            force = now - first_seen >= self.settle
            v = self.conclude(job, incident_id, first_seen=first_seen, now_wall=now, force=force)
            if v is not None or force:
                break
            time.sleep(self.poll)
        if v is None or force:
            return v
        time.sleep(max(0.0, first_seen + self.settle - time.time()))
        return self.add_late_reports(job, incident_id, v)

    def add_late_reports(self, job: str, incident_id: str, v: JobVerdict) -> JobVerdict:
        names = self.names(job, incident_id)
        late = [n for n in names if n.node not in set(v.nodes)]
        if not late:
            return v
        timeline = self.root.parent
        evidence = dict(zip(v.nodes, v.evidence, strict=False))
        for n in late:
            evidence[n.node] = str(timeline / n.evidence_name)
        nodes = tuple(sorted(evidence))
        full = replace(v, nodes=nodes, evidence=tuple(evidence[n] for n in nodes))
        d = self.incident_dir(job, incident_id)
        data = _verdict_bytes(full)
        write_atomic(d / JOB_VERDICT_FILE, data)
        self.io.writes += 1
        self.io.bytes_written += len(data)
        return full


def report_for_job(
    store: JobVerdictStore, report: IncidentReport, view: dict[str, Any] | None = None
) -> threading.Thread | None:
    """Files a node's incident, with the view of its ranks, for the job verdict; the claimant
    assembles it in a thread (the one returned: join it before exiting, or the verdict may be
    left unwritten)."""
    if report.evidence is None:
        return None
    v = report.verdict
    # First-hand only when the blamed rank is one this node dumped (it runs here).
    local_ranks = {d.rank for d in report.evidence.dumps}
    remote = v.culprit is None or v.culprit not in local_ranks
    node_report = NodeReport(
        node=report.node,
        culprit=v.culprit,
        where=Where.REMOTE if remote else Where.LOCAL,
        evidence=str(report.evidence.path),
        kind=v.kind.value,
        summary=v.summary,
        wall=time.time(),
        view=view,
    )
    try:
        claimed = store.file(report.job, v.incident_id, node_report)
    except OSError as e:
        log.error("could not file the report for the job verdict under %s: %s", store.root, e)
        return None
    if not claimed:
        return None

    def assemble_job_verdict() -> None:
        try:
            jv = store.wait_and_conclude(report.job, v.incident_id, node_report.wall)
        except OSError as e:
            log.error("could not write the job verdict under %s: %s", store.root, e)
            return
        if jv is not None:
            log.warning(
                "job verdict for %s: culprit rank %s on node %s (%s), %d nodes reported, in %s",
                jv.incident_id, jv.culprit, jv.culprit_node or "?", jv.basis, len(jv.nodes),
                store.incident_dir(report.job, v.incident_id),
            )  # fmt: skip

    thread = threading.Thread(target=assemble_job_verdict, name="diag-job-verdict", daemon=True)
    thread.start()
    return thread
