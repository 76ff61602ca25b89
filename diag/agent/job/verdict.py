"""One verdict per incident for the whole job, agreed through the shared timeline volume.

Nothing is written in steady state. On an incident:

    <timeline>/.jobs/<job>/<incident id>/
        reports/<report name>     one per node that files: first-hand ones, and views in a fallback
        claim                     created with O_CREAT|O_EXCL: its creator assembles the verdict
        first-hand                made by a first-hand report that finds another node's claim
        job-verdict.json          the job's verdict, put in place by link(2), so there is one

A node that blames one of its own ranks (it saw it die, or sit outside the collective the others
wait in) files at once. A node that only waits for ranks elsewhere files nothing while such a
report covers the incident: it looks once at its verdict and once `view_after` (1 s) later
(one listing of the job's incidents each time), and files its view of its ranks only when no
first-hand report came (the culprit's node saw nothing, or its agent is gone). The claimant
reads the views as they come and runs the culprit analysis over them (`nodeview.py`) once they
hold every rank of the job; while a view is missing it waits for a first-hand report until the
settle time since it filed its view has run out (`fallback.py`; the claimant's loop is
`claimant.py`). Which incident a node's incident
belongs to, and whether it files, is decided in `decisions.py`; this module is the file
adapter. The filesystem's exclusive create is the only arbitration: no home-made consensus.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path

from diag.agent.job import claimant
from diag.agent.job.assembly import pick_culprit, ready
from diag.agent.job.decisions import (
    JOB_VERDICT_FORMAT,
    Claim,
    JobVerdict,
    Known,
    NodeReport,
    ReportName,
    Where,
    attempt_of,
    fresh,
    parse_name,
)
from diag.agent.job.fallback import QUIET
from diag.agent.job.files import (
    MAX_CLAIM_BYTES,
    MAX_VERDICT_BYTES,
    IOCount,
    beneath,
    exists,
    read_report,
    verdict_bytes,
    verdict_from,
)
from diag.formats.incidentdir import find_dirs, incident_key
from diag.formats.journalmeta import safe_job_name
from diag.formats.untrusted import (
    UntrustedInput,
    create_new,
    parse_json,
    read_bounded,
    write_replace,
)

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


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.~-]+", "_", name)[:100] or "node"


class JobVerdictStore:
    """The file adapter: `<root>/<job>/<incident id>/` on the shared timeline volume. Every
    file is opened beneath a descriptor of its directory, without following a symlink."""

    def __init__(
        self,
        root: Path,
        *,
        settle: float = 10.0,
        poll: float = 0.5,
        cascade: float = 1.0,
        view_after: float = 1.0,
        quiet: float = QUIET,
    ) -> None:
        self.root = root
        self.settle = settle
        self.poll = poll
        self.cascade = cascade  # a death's verdict waits this long for an earlier death
        # A node that only waits for ranks elsewhere files its view this long after its verdict
        # when no first-hand report came by then (the local verdicts of one stall come within a
        # fraction of a second of each other): the claimant reads the views as they come, and
        # a first-hand report still wins until they hold every rank (fallback.py).
        self.view_after = min(view_after, settle)
        self.quiet = quiet  # fallback.QUIET
        self.covered_wall: float | None = None  # when this claimant saw the views complete
        self.io = IOCount()

    @property
    def timeline(self) -> Path:
        return self.root.parent

    def job_dir(self, job: str) -> Path:
        return self.root / safe_job_name(job or "job")

    def incident_dir(self, job: str, incident_id: str) -> Path:
        return self.job_dir(job) / _safe(incident_id)

    @contextlib.contextmanager
    def _at(self, job: str, *parts: str, create: bool = False) -> Iterator[int]:
        """A descriptor of `<root>/<job>/<parts...>` (the root is the agent's own option)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            root = os.open(self.root, flags)
        except FileNotFoundError:
            if not create:
                raise
            self.root.mkdir(parents=True, exist_ok=True)
            root = os.open(self.root, flags)
        try:
            names = [safe_job_name(job or "job"), *parts]
            with beneath(root, self.root, names, create) as d:
                yield d
        finally:
            os.close(root)

    def file(self, job: str, incident_id: str, report: NodeReport) -> bool:
        """Files this node's report; True when this node holds the claim (and so assembles)."""
        # Field by field, not asdict(): that deep-copies the view (hundreds of nested objects)
        # and took three quarters of a filing's time; json.dumps only reads it.
        doc = {f.name: getattr(report, f.name) for f in fields(report)}
        data = json.dumps({**doc, "where": report.where.value}).encode()
        with self._at(job, _safe(incident_id), create=True) as d:
            where = self.incident_dir(job, incident_id)
            with beneath(d, where, [REPORTS_DIR], create=True) as reports:
                write_replace(reports, report.name(), data)
            self.io.writes += 1
            self.io.bytes_written += len(data)
            try:
                fd = create_new(CLAIM_FILE, dir_fd=d, mode=0o644)
            except FileExistsError:
                if report.where == Where.LOCAL and report.culprit is not None:
                    self._mark(d)
                return False
        claim = Claim(report.node, report.where, report.culprit, report.first_sign_wall)
        with os.fdopen(fd, "w") as f:
            f.write(claim.text())
        self.io.writes += 1
        return True

    def _mark(self, d: int) -> None:
        """A first-hand report under another node's claim: one stat tells the claimant (and
        the nodes about to file their views) instead of a listing of every report."""
        try:
            os.close(create_new(FIRST_HAND_FILE, dir_fd=d, mode=0o644))
            self.io.writes += 1
        except FileExistsError:
            pass

    def known(self, job: str, attempt: int | None, since_wall: float) -> list[Known]:
        """The job's incidents of `attempt`: one listing of the job's directory, a time check
        of each one's claim, and a read of the claims made since `since_wall` (the others are
        an earlier run's: their time is all that matters)."""
        self.io.listings += 1
        out = []
        try:
            with self._at(job) as jd:
                entries = os.listdir(jd)
                self.io.bytes_read += sum(len(e) for e in entries)
                for e in entries:
                    if e.startswith(".") or attempt_of(e) != attempt:
                        continue
                    claimed, claim = self._claim(jd, self.job_dir(job) / e, since_wall)
                    if claimed is not None:
                        out.append(Known(e, claimed, claim))
        except FileNotFoundError:
            return []
        return out

    def _claim(self, jd: int, d: Path, since_wall: float) -> tuple[float | None, Claim | None]:
        self.io.stats += 1
        try:
            with beneath(jd, d.parent, [d.name]) as fd:
                try:
                    t = os.stat(CLAIM_FILE, dir_fd=fd, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    self.io.stats += 1  # made a moment ago, its claim not yet written
                    return os.fstat(fd).st_mtime, None
                if not fresh(t, since_wall):
                    return t, None
                return t, self._read_claim(fd, d)
        except FileNotFoundError:
            return None, None
        except UntrustedInput as e:
            log.warning("ignoring the incident %s", e)
            return None, None

    def _read_claim(self, d: int, where: Path) -> Claim | None:
        try:
            raw = read_bounded(CLAIM_FILE, max_bytes=MAX_CLAIM_BYTES, dir_fd=d)
        except UntrustedInput as e:
            log.warning("ignoring the claim %s: %s", where / CLAIM_FILE, e.problem)
            return None
        self.io.reads += 1
        self.io.bytes_read += len(raw)
        return Claim.parse(raw.decode(errors="replace"))

    def settled(self, k: Known, job: str) -> Known:
        """`k` with whether its verdict is in place and whether a first-hand report came."""
        self.io.stats += 2
        try:
            with self._at(job, _safe(k.incident_id)) as d:
                return replace(
                    k, verdict=exists(d, JOB_VERDICT_FILE), marked=exists(d, FIRST_HAND_FILE)
                )
        except FileNotFoundError:
            return k

    def first_hand_marked(self, job: str, incident_id: str) -> bool:
        self.io.stats += 1
        try:
            with self._at(job, _safe(incident_id)) as d:
                return exists(d, FIRST_HAND_FILE)
        except FileNotFoundError:
            return False

    def names(
        self, job: str, incident_id: str, parsed: dict[str, ReportName | None] | None = None
    ) -> list[ReportName]:
        """The reports' names. `parsed`: names parsed at an earlier listing of the same
        directory (a claimant lists thousands every poll; each is parsed once)."""
        self.io.listings += 1
        try:
            with self._at(job, _safe(incident_id), REPORTS_DIR) as d:
                entries = os.listdir(d)
        except FileNotFoundError:
            return []
        self.io.bytes_read += sum(len(e) for e in entries)  # the names are the listing's payload
        if parsed is None:
            parsed = {}
        out = []
        odd = 0
        for e in entries:
            n = parsed[e] if e in parsed else parsed.setdefault(e, parse_name(e))
            if n is not None:
                out.append(n)
            elif not e.startswith("."):
                odd += 1
        if odd:
            log.warning("ignoring %d files in %s whose names are not reports' names", odd,
                        self.incident_dir(job, incident_id) / REPORTS_DIR)  # fmt: skip
        return out

    def _read(self, d: int, n: ReportName, where: Path) -> NodeReport | None:
        """A node's report, or None (with a warning naming it) when it is not one: a bad
        report leaves that node out, as a missing one does."""
        path = os.path.join(where, n.file)  # a str: made for each of thousands of reports
        try:
            r, size = read_report(d, n, path, self.timeline)
        except UntrustedInput as e:
            log.warning("ignoring the report %s: %s", path, e.problem)
            return None
        self.io.reads += 1
        self.io.bytes_read += size
        return r

    def read_reports(
        self, job: str, incident_id: str, names: list[ReportName]
    ) -> dict[str, NodeReport]:
        where = self.incident_dir(job, incident_id) / REPORTS_DIR
        out: dict[str, NodeReport] = {}
        if not names:
            return out
        try:
            with self._at(job, _safe(incident_id), REPORTS_DIR) as d:
                for n in names:
                    r = self._read(d, n, where)
                    if r is not None:
                        out[n.file] = r
        except FileNotFoundError:
            pass
        return out

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

    # The claimant's side (claimant.py), as methods of the store it works through.
    conclude = claimant.conclude
    wait_and_conclude = claimant.wait_and_conclude

    def publish(self, d: Path, verdict: JobVerdict) -> bool:
        """True when this verdict is the one in place (`d`: its incident directory)."""
        with self._at(d.parent.name, d.name) as fd:
            return self._publish(fd, verdict)

    def _publish(self, d: int, verdict: JobVerdict) -> bool:
        data = verdict_bytes(verdict)
        tmp = f".{JOB_VERDICT_FILE}.{secrets.token_hex(8)}.tmp"
        with os.fdopen(create_new(tmp, dir_fd=d, mode=0o644), "wb") as f:
            f.write(data)
        try:
            # link(2) neither follows nor replaces what is at the name: one verdict stands.
            os.link(tmp, JOB_VERDICT_FILE, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
            self.io.writes += 1
            self.io.bytes_written += len(data)
            return True
        except FileExistsError:
            return False  # another agent concluded first: theirs stands
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=d)

    def load(self, job: str, incident_id: str) -> JobVerdict | None:
        """The verdict in place, None when there is none; raises UntrustedInput naming the
        file when what is there is not a verdict."""
        path = self.incident_dir(job, incident_id) / JOB_VERDICT_FILE
        try:
            with self._at(job, _safe(incident_id)) as d:
                if not exists(d, JOB_VERDICT_FILE):
                    return None
                raw = read_bounded(JOB_VERDICT_FILE, max_bytes=MAX_VERDICT_BYTES, dir_fd=d)
        except FileNotFoundError:
            return None
        except UntrustedInput as e:
            raise UntrustedInput(path, e.problem) from None
        self.io.reads += 1
        self.io.bytes_read += len(raw)
        v = verdict_from(parse_json(path, raw), str(path), self.timeline)
        # Where the nodes' directories are is this node's business, not the file's.
        return replace(v, evidence_glob=self.evidence_glob(v.job, v.incident_id))

    def claimed_first_hand(self, job: str, incident_id: str) -> bool:
        try:
            with self._at(job, _safe(incident_id)) as d:
                if not exists(d, CLAIM_FILE):
                    return False
                claim = self._read_claim(d, self.incident_dir(job, incident_id))
        except FileNotFoundError:
            return False
        return claim is not None and claim.where == Where.LOCAL

    def replace_verdict(self, job: str, incident_id: str, verdict: JobVerdict) -> None:
        """Puts `verdict` over the one in place (the same verdict, with late reports added)."""
        data = verdict_bytes(verdict)
        with self._at(job, _safe(incident_id)) as d:
            write_replace(d, JOB_VERDICT_FILE, data)
        self.io.writes += 1
        self.io.bytes_written += len(data)
