"""One verdict per incident for the whole job, agreed through the shared timeline volume.

Nothing is written in steady state. On an incident:

    <timeline>/.jobs/<job>/<incident id>/
        reports/<report name>     one per node that files: first-hand ones, and views in a fallback
        claim                     created with O_CREAT|O_EXCL: its creator assembles the verdict
        first-hand                made by a first-hand report that finds another node's claim
        job-verdict.json          the job's verdict, put in place by link(2), so there is one

A node that blames one of its own ranks (it saw it die, or sit outside the collective the others
wait in) files at once. A node that only waits for ranks elsewhere files nothing while such a
report covers the incident: it looks once at its verdict and once at the end of the settle time
(one listing of the job's incidents each time), and files its view of its ranks only when no
first-hand report came (the culprit's node saw nothing, or its agent is gone). The claimant
then runs the culprit analysis over the views (`nodeview.py`). Which incident a node's incident
belongs to, and whether it files, is decided in `jobincident.py`; this module is the file
adapter. The filesystem's exclusive create is the only arbitration: no home-made consensus.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from diag.agent.incident import find_dirs, incident_key
from diag.agent.jobincident import (
    DEATH,
    JOB_VERDICT_FORMAT,
    Claim,
    JobVerdict,
    Known,
    NodeReport,
    ReportName,
    Where,
    assemble,
    attempt_of,
    fresh,
    kind_of,
    parse_name,
    pick_culprit,
    ready,
)
from diag.agent.nodeview import analyse, fold_rank_lists
from diag.collector.meta import safe_job_name, write_atomic

log = logging.getLogger(__name__)

JOB_VERDICT_FILE = "job-verdict.json"
CLAIM_FILE = "claim"
FIRST_HAND_FILE = "first-hand"
REPORTS_DIR = "reports"

__all__ = [
    "CLAIM_FILE", "JOB_VERDICT_FILE", "JOB_VERDICT_FORMAT", "REPORTS_DIR", "IOCount",
    "JobVerdict", "JobVerdictStore", "NodeReport", "ReportName", "Where", "parse_name",
    "pick_culprit", "ready",
]  # fmt: skip


def _from_views(reports: list[NodeReport], now_wall: float) -> tuple[int, str, str] | None:
    """(rank, node, basis) from the culprit analysis over every report's view; None when the
    views name no single rank."""
    views = [r.view for r in reports if r.view is not None]
    a = analyse(views, now_wall)
    if a.culprit is None:
        return None
    return a.culprit, a.node, f"from the views of {len(views)} nodes: {fold_rank_lists(a.reason)}"


def _verdict_bytes(verdict: JobVerdict) -> bytes:
    doc = {"format": JOB_VERDICT_FORMAT, **asdict(verdict)}
    if verdict.first_hand is not None:
        doc["first_hand"]["where"] = verdict.first_hand.where.value
    return json.dumps(doc, indent=1).encode()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.~-]+", "_", name)[:100] or "node"


class IOCount:
    """File operations on the shared volume, by kind (what a network filesystem charges)."""

    def __init__(self) -> None:
        self.writes = 0  # files created or replaced, directories made
        self.reads = 0  # files read
        self.listings = 0  # directories listed
        self.stats = 0  # existence and time checks
        self.bytes_written = 0
        self.bytes_read = 0  # file contents, and the names a listing returns

    def add(self, other: IOCount) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)


class JobVerdictStore:
    """The file adapter: `<root>/<job>/<incident id>/` on the shared timeline volume."""

    def __init__(
        self, root: Path, *, settle: float = 10.0, poll: float = 0.5, cascade: float = 1.0
    ) -> None:
        self.root = root
        self.settle = settle
        self.poll = poll
        self.cascade = cascade  # a death's verdict waits this long for an earlier death
        self.io = IOCount()

    @property
    def timeline(self) -> Path:
        return self.root.parent

    def job_dir(self, job: str) -> Path:
        return self.root / safe_job_name(job or "job")

    def incident_dir(self, job: str, incident_id: str) -> Path:
        return self.job_dir(job) / _safe(incident_id)

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
            if report.where == Where.LOCAL and report.culprit is not None:
                self._mark(d)
            return False
        claim = Claim(report.node, report.where, report.culprit, report.first_sign_wall)
        with os.fdopen(fd, "w") as f:
            f.write(claim.text())
        self.io.writes += 1
        return True

    def _mark(self, d: Path) -> None:
        """A first-hand report under another node's claim: one stat tells the claimant (and
        the nodes about to file their views) instead of a listing of every report."""
        try:
            os.close(os.open(d / FIRST_HAND_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            self.io.writes += 1
        except FileExistsError:
            pass

    def known(self, job: str, attempt: int | None, since_wall: float) -> list[Known]:
        """The job's incidents of `attempt`: one listing of the job's directory, a time check
        of each one's claim, and a read of the claims made since `since_wall` (the others are
        an earlier run's: their time is all that matters)."""
        d = self.job_dir(job)
        self.io.listings += 1
        try:
            entries = os.listdir(d)
        except FileNotFoundError:
            return []
        self.io.bytes_read += sum(len(e) for e in entries)
        out = []
        for e in entries:
            if e.startswith(".") or attempt_of(e) != attempt:
                continue
            claimed, claim = self._claim(d / e, since_wall)
            if claimed is not None:
                out.append(Known(e, claimed, claim))
        return out

    def _claim(self, d: Path, since_wall: float) -> tuple[float | None, Claim | None]:
        self.io.stats += 1
        try:
            t = (d / CLAIM_FILE).stat().st_mtime
        except FileNotFoundError:
            try:  # made a moment ago, its claim not yet written
                self.io.stats += 1
                return d.stat().st_mtime, None
            except FileNotFoundError:
                return None, None
        if not fresh(t, since_wall):
            return t, None
        try:
            raw = (d / CLAIM_FILE).read_bytes()
        except FileNotFoundError:
            return t, None
        self.io.reads += 1
        self.io.bytes_read += len(raw)
        return t, Claim.parse(raw.decode(errors="replace"))

    def settled(self, k: Known, job: str) -> Known:
        """`k` with whether its verdict is in place and whether a first-hand report came."""
        d = self.incident_dir(job, k.incident_id)
        self.io.stats += 2
        return replace(
            k, verdict=(d / JOB_VERDICT_FILE).exists(), marked=(d / FIRST_HAND_FILE).exists()
        )

    def first_hand_marked(self, job: str, incident_id: str) -> bool:
        self.io.stats += 1
        return (self.incident_dir(job, incident_id) / FIRST_HAND_FILE).exists()

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

    def evidence_glob(self, job: str, incident_id: str) -> str:
        """Where every node's incident directory of this incident is: the agents name them
        after the job's incident id (`incident.dir_name`)."""
        return str(
            self.timeline / f"*@{incident_key(f'{job}-{incident_id}' if job else incident_id)}"
        )

    def evidence_dirs(self, verdict: JobVerdict) -> list[Path]:
        """Every node's incident directory of the verdict's incident: one listing."""
        key = incident_key(
            f"{verdict.job}-{verdict.incident_id}" if verdict.job else verdict.incident_id
        )
        return find_dirs(self.timeline, key)

    def conclude(
        self, job: str, incident_id: str, *, first_seen: float, now_wall: float, force: bool
    ) -> JobVerdict | None:
        """One attempt: lists the reports, and when `ready` (or `force`) reads the first-hand
        ones (those of the suspects' nodes; in a fallback, every report and its view) and puts
        the job verdict in place (once: link(2) refuses a second)."""
        names = self.names(job, incident_id)
        cascade = self.cascade if kind_of(incident_id) == DEATH else 0.0
        if not names or not (
            force or ready(names, first_seen, now_wall, self.settle, cascade=cascade)
        ):
            return None
        d = self.incident_dir(job, incident_id)
        first_hand = any(n.where == Where.LOCAL and n.culprit is not None for n in names)
        read: dict[str, NodeReport] = {}
        for n in names:
            if n.where == Where.LOCAL or not first_hand:
                r = self._read(d / REPORTS_DIR / n.file)
                if r is not None:
                    read[n.file] = r
        pick = pick_culprit(names, read)
        if not first_hand:
            pick = _from_views(list(read.values()), now_wall) or pick
        # Evidence directories sit in the timeline, named in each report's name.
        evidence = {
            n.file: (read[n.file].evidence if n.file in read else str(self.timeline / n.evidence_name))
            for n in names
        }  # fmt: skip
        verdict = assemble(
            incident_id, job, names, read, evidence, now_wall, pick,
            evidence_glob=self.evidence_glob(job, incident_id),
        )  # fmt: skip
        if self.publish(d, verdict):
            return verdict
        return self.load(job, incident_id)

    def publish(self, d: Path, verdict: JobVerdict) -> bool:
        """True when this verdict is the one in place."""
        data = _verdict_bytes(verdict)
        tmp = d / f".{JOB_VERDICT_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        try:
            os.link(tmp, d / JOB_VERDICT_FILE)
            self.io.writes += 1
            self.io.bytes_written += len(data)
            return True
        except FileExistsError:
            return False  # another agent concluded first: theirs stands
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def load(self, job: str, incident_id: str) -> JobVerdict | None:
        path = self.incident_dir(job, incident_id) / JOB_VERDICT_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        self.io.reads += 1
        self.io.bytes_read += len(raw)
        doc = json.loads(raw)
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
            evidence_glob=doc.get("evidence_glob", ""),
            reports=int(doc.get("reports", len(doc["nodes"]))),
        )

    def wait_and_conclude(
        self,
        job: str,
        incident_id: str,
        first_seen: float,
        on_verdict: Callable[[JobVerdict], None] | None = None,
    ) -> JobVerdict | None:
        """The claimant's loop: one listing per `poll` seconds until ready, at most `settle`.
        A verdict reached early (a first-hand report) gets the nodes that report first-hand
        later added once, at the end of the settle time; its culprit stays."""
        # Views may be filed by thousands of nodes: list them only once a first-hand report
        # is known to be there (the claim or the marker says so), or at the end.
        first_hand = self._claimed_first_hand(job, incident_id)
        while True:
            now = time.time()
            force = now - first_seen >= self.settle
            first_hand = first_hand or self.first_hand_marked(job, incident_id)
            v = None
            if force or first_hand:
                v = self.conclude(
                    job, incident_id, first_seen=first_seen, now_wall=now, force=force
                )
            if v is not None or force:
                break
            time.sleep(self.poll)
        if v is not None and on_verdict is not None:
            on_verdict(v)
        if v is None or force:
            return v
        time.sleep(max(0.0, first_seen + self.settle - time.time()))
        return self.add_late_reports(job, incident_id, v)

    def _claimed_first_hand(self, job: str, incident_id: str) -> bool:
        try:
            raw = (self.incident_dir(job, incident_id) / CLAIM_FILE).read_bytes()
        except FileNotFoundError:
            return False
        self.io.reads += 1
        self.io.bytes_read += len(raw)
        claim = Claim.parse(raw.decode(errors="replace"))
        return claim is not None and claim.where == Where.LOCAL

    def add_late_reports(self, job: str, incident_id: str, v: JobVerdict) -> JobVerdict:
        names = self.names(job, incident_id)
        late = [n for n in names if n.where == Where.LOCAL and n.node not in set(v.nodes)]
        count = len({n.node for n in names})
        if not late and count == v.reports:
            return v
        evidence = dict(zip(v.nodes, v.evidence, strict=False))
        d = self.incident_dir(job, incident_id)
        for n in late:
            r = self._read(d / REPORTS_DIR / n.file)  # its name may cut a long directory name
            evidence[n.node] = r.evidence if r else str(self.timeline / n.evidence_name)
        nodes = tuple(sorted(evidence))
        full = replace(v, nodes=nodes, evidence=tuple(evidence[n] for n in nodes), reports=count)
        data = _verdict_bytes(full)
        write_atomic(d / JOB_VERDICT_FILE, data)
        self.io.writes += 1
        self.io.bytes_written += len(data)
        return full
