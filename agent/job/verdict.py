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
settle time since its own verdict has run out (`fallback.py`). Which incident a node's incident
belongs to, and whether it files, is decided in `jobincident.py`; this module is the file
adapter. The filesystem's exclusive create is the only arbitration: no home-made consensus.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path

from diag.agent.job.decisions import (
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
from diag.agent.job.fallback import (
    QUIET,
    Progress,
    Step,
    Views,
    first_hand_in,
    from_views,
    step,
    wake_in,
)
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
        # fraction of a second of each other): the claimant reads the views while the rest of
        # the settle time runs, and a first-hand report still wins until it has run out.
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

    def _read_all(
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

    def conclude(
        self,
        job: str,
        incident_id: str,
        *,
        first_seen: float,
        now_wall: float,
        force: bool,
        names: list[ReportName] | None = None,
        cached: dict[str, NodeReport] | None = None,
        pick: tuple[int | None, str, str] | None = None,
    ) -> JobVerdict | None:
        """One attempt: lists the reports, and when `ready` (or `force`) reads the first-hand
        ones (those of the suspects' nodes; in a fallback, every report and its view) and puts
        the job verdict in place (once: link(2) refuses a second). `pick`: in a fallback, the
        culprit the analysis of the views `cached` already found."""
        if names is None:
            names = self.names(job, incident_id)
        cascade = self.cascade if kind_of(incident_id) == DEATH else 0.0
        if not names or not (
            force or ready(names, first_seen, now_wall, self.settle, cascade=cascade)
        ):
            return None
        first_hand = any(n.where == Where.LOCAL and n.culprit is not None for n in names)
        wanted = [n for n in names if n.where == Where.LOCAL or not first_hand]
        cached = cached or {}
        read = {n.file: cached[n.file] for n in wanted if n.file in cached}
        read.update(self._read_all(job, incident_id, [n for n in wanted if n.file not in read]))
        if first_hand or pick is None:
            pick = pick_culprit(names, read)
            if not first_hand:
                pick = from_views(list(read.values()), now_wall) or pick
        # Evidence directories sit in the timeline, named in each report's name.
        evidence = {
            n.file: (read[n.file].evidence if n.file in read else str(self.timeline / n.evidence_name))
            for n in names
        }  # fmt: skip
        verdict = assemble(
            incident_id, job, names, read, evidence, now_wall, pick,
            evidence_glob=self.evidence_glob(job, incident_id),
        )  # fmt: skip
        if self.publish(self.incident_dir(job, incident_id), verdict):
            return verdict
        try:
            return self.load(job, incident_id)
        except UntrustedInput as e:
            log.warning("ignoring the job verdict %s", e)
            return None

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

    def wait_and_conclude(
        self,
        job: str,
        incident_id: str,
        first_seen: float,
        on_verdict: Callable[[JobVerdict], None] | None = None,
        *,
        until: float | None = None,
    ) -> JobVerdict | None:
        """The claimant's loop: one listing per `poll` seconds until ready, at most `settle`.
        A verdict reached early (a first-hand report) gets the nodes that report first-hand
        later added once, at the end of the settle time; its culprit stays. A fallback (views
        only) concludes as `fallback.step` says: once the views hold every rank, or when the
        settle time has run out with a view missing; `until`: the end of that settle time
        (default `first_seen` + settle; a claimant that filed its view `view_after` its verdict
        passes its verdict's)."""
        # Views may be filed by thousands of nodes: with a first-hand report known (the claim
        # or the marker says so) only first-hand reports are read; without, each view is read
        # once as it comes, and the analysis runs once, when the views hold every rank.
        deadline = first_seen + self.settle if until is None else until
        first_hand = self._claimed_first_hand(job, incident_id)
        got = Views()
        parsed: dict[str, ReportName | None] = {}
        covered: tuple[list[ReportName], tuple[int | None, str, str]] | None = None
        covered_at: float | None = None
        while True:
            first_hand = first_hand or self.first_hand_marked(job, incident_id)
            if not first_hand and covered is None:
                names = self.names(job, incident_id, parsed)
                first_hand = first_hand_in(names)
                if not first_hand and self._views_cover(job, incident_id, names, got):
                    # No view is to come that could change the analysis: it runs now, while
                    # the claimant still looks for a first-hand report (`fallback.QUIET`).
                    covered_at = self.covered_wall = time.time()
                    covered = (names, got.pick(names, covered_at + self.quiet))
            now = time.time()
            s = step(Progress(first_hand, covered_at), now, deadline=deadline, quiet=self.quiet)
            if s == Step.FIRST_HAND:
                force = now - first_seen >= self.settle
                v = self.conclude(
                    job, incident_id, first_seen=first_seen, now_wall=now, force=force,
                    cached=got.reports,
                )  # fmt: skip
                if v is not None or force:
                    break
            elif s == Step.VIEWS and self.first_hand_marked(job, incident_id):
                first_hand = True  # a node changed its mind: its report wins
                continue
            elif s != Step.WAIT:
                names, pick = covered if covered is not None else (None, None)
                v = self.conclude(
                    job, incident_id, first_seen=first_seen, now_wall=now, force=True,
                    names=names, cached=got.reports, pick=pick,
                )  # fmt: skip
                force = True
                break
            time.sleep(wake_in(Progress(first_hand, covered_at), time.time(),
                               deadline=deadline, poll=self.poll, quiet=self.quiet))  # fmt: skip
        if v is not None and on_verdict is not None:
            on_verdict(v)
        if v is None or force:
            return v
        time.sleep(max(0.0, first_seen + self.settle - time.time()))
        return self.add_late_reports(job, incident_id, v)

    def _views_cover(self, job: str, incident_id: str, names: list[ReportName], got: Views) -> bool:
        """Reads the reports not read yet (into `got`, so that each is read once however
        often the claimant looks); True when their views hold every rank of the job."""
        got.add(self._read_all(job, incident_id, [n for n in names if n.file not in got.reports]))
        return got.cover

    def _claimed_first_hand(self, job: str, incident_id: str) -> bool:
        try:
            with self._at(job, _safe(incident_id)) as d:
                if not exists(d, CLAIM_FILE):
                    return False
                claim = self._read_claim(d, self.incident_dir(job, incident_id))
        except FileNotFoundError:
            return False
        return claim is not None and claim.where == Where.LOCAL

    def add_late_reports(self, job: str, incident_id: str, v: JobVerdict) -> JobVerdict:
        names = self.names(job, incident_id)
        late = [n for n in names if n.where == Where.LOCAL and n.node not in set(v.nodes)]
        count = len({n.node for n in names})
        if not late and count == v.reports:
            return v
        evidence = dict(zip(v.nodes, v.evidence, strict=False))
        read = self._read_all(job, incident_id, late)  # a name may cut a long directory name
        for n in late:
            r = read.get(n.file)
            evidence[n.node] = r.evidence if r else str(self.timeline / n.evidence_name)
        nodes = tuple(sorted(evidence))
        full = replace(v, nodes=nodes, evidence=tuple(evidence[n] for n in nodes), reports=count)
        data = verdict_bytes(full)
        with self._at(job, _safe(incident_id)) as d:
            write_replace(d, JOB_VERDICT_FILE, data)
        self.io.writes += 1
        self.io.bytes_written += len(data)
        return full
