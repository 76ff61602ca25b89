"""The claimant's side of the job verdict: the node that holds an incident's claim waits for
the reports it needs, assembles the verdict and puts it in place (`JobVerdictStore` is the file
adapter it works through; `fallback.py` says when a claimant of views concludes).

A first-hand report (a node blaming its own rank) is concluded on at once (a death `cascade`
seconds after the first, so that an earlier death reported a moment later still leads), and the
nodes that report first-hand later within the settle time are added to it once. Without one,
the views are read as they come, each once, and concluded on once they hold every rank of the
job, or when the settle time has run out with a view missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from diag.agent.job.assembly import assemble, pick_culprit, ready
from diag.agent.job.decisions import DEATH, JobVerdict, NodeReport, ReportName, Where, kind_of
from diag.agent.job.fallback import Progress, Step, Views, first_hand_in, from_views, step, wake_in
from diag.agent.job.silence import LostNode, blame_lost
from diag.formats.untrusted import UntrustedInput

log = logging.getLogger(__name__)


class JobVerdictStore(Protocol):
    """What the claimant works through: the job verdict's files (verdict.py's store, which
    imports this module to run the claimant)."""

    settle: float
    poll: float
    cascade: float
    quiet: float
    covered_wall: float | None

    @property
    def timeline(self) -> Path: ...

    def incident_dir(self, job: str, incident_id: str) -> Path: ...

    def names(
        self, job: str, incident_id: str, parsed: dict[str, ReportName | None] | None = None
    ) -> list[ReportName]: ...

    def read_reports(
        self, job: str, incident_id: str, names: list[ReportName]
    ) -> dict[str, NodeReport]: ...

    def evidence_glob(self, job: str, incident_id: str) -> str: ...

    def publish(self, d: Path, verdict: JobVerdict) -> bool: ...

    def load(self, job: str, incident_id: str) -> JobVerdict | None: ...

    def claimed_first_hand(self, job: str, incident_id: str) -> bool: ...

    def first_hand_marked(self, job: str, incident_id: str) -> bool: ...

    def replace_verdict(self, job: str, incident_id: str, verdict: JobVerdict) -> None: ...


def conclude(
    store: JobVerdictStore,
    job: str,
    incident_id: str,
    *,
    first_seen: float,
    now_wall: float,
    force: bool,
    names: list[ReportName] | None = None,
    cached: dict[str, NodeReport] | None = None,
    pick: tuple[int | None, str, str] | None = None,
    lost: tuple[LostNode, ...] = (),
) -> JobVerdict | None:
    """One attempt: lists the reports, and when `ready` (or `force`) reads the first-hand
    ones (those of the suspects' nodes; in a fallback, every report and its view) and puts
    the job verdict in place (once: link(2) refuses a second). `pick`: in a fallback, the
    culprit the analysis of the views `cached` already found. `lost`: peers whose agents went
    silent (silence.py): the first is the culprit, whatever the reports say."""
    if names is None:
        names = store.names(job, incident_id)
    cascade = store.cascade if kind_of(incident_id) == DEATH else 0.0
    if not names or not (
        force or ready(names, first_seen, now_wall, store.settle, cascade=cascade)
    ):
        return None
    first_hand = any(n.where == Where.LOCAL and n.culprit is not None for n in names)
    wanted = [n for n in names if n.where == Where.LOCAL or not first_hand]
    cached = cached or {}
    read = {n.file: cached[n.file] for n in wanted if n.file in cached}
    read.update(store.read_reports(job, incident_id, [n for n in wanted if n.file not in read]))
    if first_hand or pick is None:
        pick = pick_culprit(names, read)
        if not first_hand:
            pick = from_views(list(read.values()), now_wall) or pick
    if lost:
        pick = blame_lost(names, lost)
    # Evidence directories sit in the timeline, named in each report's name.
    evidence = {
        n.file: (read[n.file].evidence if n.file in read else str(store.timeline / n.evidence_name))
        for n in names
    }  # fmt: skip
    verdict = assemble(
        incident_id, job, names, read, evidence, now_wall, pick,
        evidence_glob=store.evidence_glob(job, incident_id),
        lost_nodes=tuple(n.node for n in lost),
    )  # fmt: skip
    if store.publish(store.incident_dir(job, incident_id), verdict):
        return verdict
    try:
        return store.load(job, incident_id)
    except UntrustedInput as e:
        log.warning("ignoring the job verdict %s", e)
        return None


def wait_and_conclude(
    store: JobVerdictStore,
    job: str,
    incident_id: str,
    first_seen: float,
    on_verdict: Callable[[JobVerdict], None] | None = None,
    lost: tuple[LostNode, ...] = (),
) -> JobVerdict | None:
    """The claimant's loop: one listing per `poll` seconds until ready, at most `settle`.
    A verdict reached early (a first-hand report) gets the nodes that report first-hand
    later added once, at the end of the settle time; its culprit stays. A fallback (views
    only) concludes as `fallback.step` says: once the views hold every rank, or when the
    settle time since `first_seen` (its own filing) has run out with a view missing."""
    # Views may be filed by thousands of nodes: with a first-hand report known (the claim
    # or the marker says so) only first-hand reports are read; without, each view is read
    # once as it comes, and the analysis runs once, when the views hold every rank.
    # A claimant that files late (its agent was slow) still waits the settle time for a view
    # to come, rather than conclude at once on the few it finds.
    deadline = first_seen + store.settle
    first_hand = store.claimed_first_hand(job, incident_id)
    got = Views()
    parsed: dict[str, ReportName | None] = {}
    covered: tuple[list[ReportName], tuple[int | None, str, str]] | None = None
    covered_at: float | None = None
    while True:
        first_hand = first_hand or store.first_hand_marked(job, incident_id)
        if not first_hand and covered is None:
            names = store.names(job, incident_id, parsed)
            first_hand = first_hand_in(names)
            if not first_hand and _views_cover(store, job, incident_id, names, got):
                # No view is to come that could change the analysis: it runs now, while
                # the claimant still looks for a first-hand report (`fallback.QUIET`).
                covered_at = store.covered_wall = time.time()
                covered = (names, got.pick(names, covered_at + store.quiet))
        now = time.time()
        s = step(Progress(first_hand, covered_at), now, deadline=deadline, quiet=store.quiet)
        if s == Step.FIRST_HAND:
            force = now - first_seen >= store.settle
            v = conclude(
                store, job, incident_id, first_seen=first_seen, now_wall=now, force=force,
                cached=got.reports, lost=lost,
            )  # fmt: skip
            if v is not None or force:
                break
        elif s == Step.VIEWS and store.first_hand_marked(job, incident_id):
            first_hand = True  # a node changed its mind: its report wins
            continue
        elif s != Step.WAIT:
            names, pick = covered if covered is not None else (None, None)
            v = conclude(
                store, job, incident_id, first_seen=first_seen, now_wall=now, force=True,
                names=names, cached=got.reports, pick=pick, lost=lost,
            )  # fmt: skip
            force = True
            break
        time.sleep(wake_in(Progress(first_hand, covered_at), time.time(),
                           deadline=deadline, poll=store.poll, quiet=store.quiet))  # fmt: skip
    if v is not None and on_verdict is not None:
        on_verdict(v)
    if v is None or force:
        return v
    time.sleep(max(0.0, first_seen + store.settle - time.time()))
    return add_late_reports(store, job, incident_id, v)


def _views_cover(
    store: JobVerdictStore, job: str, incident_id: str, names: list[ReportName], got: Views
) -> bool:
    """Reads the reports not read yet (into `got`, so that each is read once however
    often the claimant looks); True when their views hold every rank of the job."""
    got.add(store.read_reports(job, incident_id, [n for n in names if n.file not in got.reports]))
    return got.cover


def add_late_reports(
    store: JobVerdictStore, job: str, incident_id: str, v: JobVerdict
) -> JobVerdict:
    """`v` with the nodes that reported first-hand after it was put in place, and the count
    of every node that filed."""
    names = store.names(job, incident_id)
    late = [n for n in names if n.where == Where.LOCAL and n.node not in set(v.nodes)]
    count = len({n.node for n in names})
    if not late and count == v.reports:
        return v
    evidence = dict(zip(v.nodes, v.evidence, strict=False))
    read = store.read_reports(job, incident_id, late)  # a name may cut a long directory name
    for n in late:
        r = read.get(n.file)
        evidence[n.node] = r.evidence if r else str(store.timeline / n.evidence_name)
    nodes = tuple(sorted(evidence))
    full = replace(v, nodes=nodes, evidence=tuple(evidence[n] for n in nodes), reports=count)
    store.replace_verdict(job, incident_id, full)
    return full
