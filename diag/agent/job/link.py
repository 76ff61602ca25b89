"""A node's side of the job verdict, run by the agent at an incident:

1. at its verdict, before any evidence is written: which job incident this one belongs to (one
   listing of the job's incidents; `jobincident.choose`), so the incident directory and its
   `verdict.json` carry the job's incident id, and a consequence (ranks that wait for a rank
   that died on another node) says so rather than opening an incident of its own;
2. once the incident directory is on disk: a first-hand report is filed at once (its claimant
   assembles the verdict in a thread); a node that only waits for ranks elsewhere files nothing
   yet, and looks again `view_after` seconds after its verdict, filing its view only if no
   first-hand report or verdict covers the incident (the fallback). A claimant of views reads
   them as they come and concludes once they hold every rank of the job (no first-hand report
   can then be on its way), or, with a view missing, once the settle time since it filed its
   own has run out (`fallback.py`). Before it concludes, a claimant with replication on asks
   its ring neighbours' agents whether they answer: one silent for `lost_after` seconds is a
   node lost whole, and the verdict names it (`silence.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from diag.agent.detect.hang import Verdict, VerdictKind
from diag.agent.detect.observation import Observation
from diag.agent.evidence.collection import IncidentReport
from diag.agent.job.decisions import (
    Filing,
    Known,
    Mine,
    NodeReport,
    Target,
    Where,
    as_consequence,
    choose,
    filing,
)
from diag.agent.job.jobstop import needs_settled
from diag.agent.job.silence import LostNode, PeerLook, judge
from diag.agent.job.verdict import JobVerdict, JobVerdictStore
from diag.formats.incidentdir import retag
from diag.formats.untrusted import UntrustedInput

log = logging.getLogger(__name__)


def ranks_since_wall(obs: Observation, now_wall: float) -> float:
    """When this node's ranks started, on the wall clock: incidents claimed before are an
    earlier run's."""
    return now_wall - (obs.now - min(r.started_at for r in obs.ranks)) if obs.ranks else 0.0


def mine_of(verdict: Verdict, obs: Observation, now_wall: float) -> Mine:
    """This node's incident on the wall clock (monotonic times converted with `now_wall`)."""

    def wall(mono: float) -> float:
        return now_wall - (obs.now - mono)

    local = {r.rank for r in obs.ranks}
    where = (
        Where.LOCAL if verdict.culprit is not None and verdict.culprit in local else Where.REMOTE
    )
    first = now_wall
    if verdict.kind == VerdictKind.RANK_EXITED and verdict.expired_at is not None:
        first = wall(verdict.expired_at)  # when its first rank was seen dead
    since = ranks_since_wall(obs, now_wall)
    return Mine(verdict.incident_id, where, first, now_wall, since)


def look(store: JobVerdictStore, job: str, mine: Mine, window: float, *, settled: bool) -> Target:
    """One look at the job's incidents: a listing, a time check and a read of the claims of
    this attempt; at its second look (`view_after`) also whether the one chosen has its verdict
    or a first-hand report (two more checks)."""
    target = choose(mine, store.known(job, mine.attempt, mine.since_wall), window)
    if settled and target.known is not None and not target.consequence:
        target = replace(target, known=store.settled(target.known, job))
    return target


def job_incident_id(job: str, incident_id: str) -> str:
    """The id an incident directory's verdict.json carries (the executor's form)."""
    return f"{job}-{incident_id}" if job else incident_id


@dataclass
class _Open:
    mine: Mine
    target: Target
    job: str
    captured: threading.Event


# How long past `lost_after` a claimant waits for its peers' probes at most (a probe's own
# timeout): a peer that cannot be judged by then counts as there.
PEER_SLACK = 6.0


class JobLink:
    def __init__(
        self,
        store: JobVerdictStore,
        node: str,
        *,
        window: float | None = None,
        peers: Callable[[], Sequence[PeerLook]] | None = None,
        lost_after: float = 5.0,
    ) -> None:
        self.store = store
        self.node = node
        # The peers this node exchanges replicas with, probed (silence.py): a claimant asks
        # whether their agents still answer before it concludes.
        self.peers = peers
        self.lost_after = lost_after
        # How long before this node's verdict another node's claim may be and still be the
        # same stall (ranks of one job see it within their hang limits of each other).
        self.window = window if window is not None else 2 * store.settle
        self._open: dict[str, _Open] = {}
        self._threads: list[threading.Thread] = []

    def resolve(self, verdict: Verdict, obs: Observation, job: str, now_wall: float) -> Verdict:
        """The verdict under the job incident it belongs to (its id and, for a consequence,
        no culprit of its own: the job verdict names it)."""
        mine = mine_of(verdict, obs, now_wall)
        try:
            target = look(self.store, job, mine, self.window, settled=False)
        except (OSError, UntrustedInput) as e:
            log.error("cannot list the job's incidents under %s: %s", self.store.root, e)
            target = choose(mine, [], self.window)
        self._open[target.incident_id] = _Open(mine, target, job, threading.Event())
        if not (target.adopted or target.consequence):
            return replace(verdict, incident_id=target.incident_id)
        why = f": {target.reason}" if target.reason else ""
        if target.adopted:
            log.warning("incident %s joins job incident %s%s", verdict.incident_id,
                        target.incident_id, why)  # fmt: skip
        else:
            log.warning("incident %s follows what another node reported%s", target.incident_id, why)
        return replace(
            verdict,
            incident_id=target.incident_id,
            culprit=None if target.consequence else verdict.culprit,
            summary=as_consequence(verdict.summary, target),
        )

    def incidents(self, job: str, attempt: int, since_wall: float) -> list[Known]:
        """The job's incidents of `attempt` for `jobstop.follow`: one listing, and for a claim
        that does not say enough by itself, whether its verdict or a first-hand report came."""
        try:
            known = self.store.known(job, attempt, since_wall)
            return [self.store.settled(k, job) if needs_settled(k) else k for k in known]
        except (OSError, UntrustedInput) as e:
            log.error("cannot list the job's incidents under %s: %s", self.store.root, e)
            return []

    def on_disk(self, report: IncidentReport, view: dict[str, Any] | None) -> None:
        o = self._open.get(report.verdict.incident_id)
        if o is None or report.evidence is None:
            return
        v = report.verdict
        node_report = NodeReport(
            node=self.node, culprit=v.culprit, where=o.mine.where,
            evidence=str(report.evidence.path), kind=v.kind.value, summary=v.summary,
            wall=time.time(), view=view, first_sign_wall=o.mine.first_sign_wall,
        )  # fmt: skip
        job = report.job or o.job
        how = filing(o.mine, o.target, settled=False)
        if how == Filing.NONE:
            log.info("no report for the job verdict: %s", o.target.reason)
            return
        if how == Filing.NOW:
            # Filed here and now (two small writes); only the claimant's wait is a thread.
            if self._file(job, o.target.incident_id, node_report):
                self._start(self._conclude, job, o.target.incident_id, node_report.wall, o.mine)
        else:
            self._start(self._settle, job, o, node_report, report.evidence.path)

    def captured(self, report: IncidentReport) -> None:
        o = self._open.get(report.verdict.incident_id)
        if o is not None:
            o.captured.set()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def longest_wait(self) -> float:
        """Settle time, then a fallback claimant's own settle time (and the claimant's
        look at its peers): what join() may need."""
        peers = self.lost_after + PEER_SLACK if self.peers is not None else 0.0
        return 2 * self.store.settle + 5.0 + peers

    def _start(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, name="diag-job-verdict", daemon=True)
        self._threads.append(t)
        t.start()

    def _settle(self, job: str, o: _Open, node_report: NodeReport, evidence: Path) -> None:
        """`view_after` seconds after its verdict: file this node's view only if nothing
        covers it."""
        time.sleep(max(0.0, o.mine.decided_wall + self.store.view_after - time.time()))
        try:
            target = look(self.store, job, o.mine, self.window, settled=True)
        except (OSError, UntrustedInput) as e:
            log.error("cannot look for the job verdict under %s: %s", self.store.root, e)
            return
        if target.incident_id != o.target.incident_id:
            # Our directory is named after the incident we thought it was; its verdict.json
            # moves it (what `diag merge` groups by), once capture has stopped writing it.
            o.captured.wait(timeout=60)
            try:
                retag(evidence, job_incident_id(job, target.incident_id),
                      f"part of job incident {target.incident_id}")  # fmt: skip
            except (OSError, ValueError) as e:
                log.error("cannot move %s into incident %s: %s", evidence, target.incident_id, e)
        if filing(o.mine, target, settled=True) == Filing.NONE:
            log.info("no report for the job verdict of %s: covered", target.incident_id)
            return
        log.warning(
            "no first-hand report for %s within %.1f s: filing this node's view",
            target.incident_id, self.store.view_after,
        )  # fmt: skip
        now = time.time()
        if self._file(job, target.incident_id, replace(node_report, wall=now)):
            self._conclude(job, target.incident_id, now, o.mine)

    def _file(self, job: str, incident_id: str, node_report: NodeReport) -> bool:
        """True when this node claimed the incident (and so assembles its verdict)."""
        try:
            return self.store.file(job, incident_id, node_report)
        except (OSError, UntrustedInput) as e:
            log.error("could not file the report for the job verdict under %s: %s",
                      self.store.root, e)  # fmt: skip
            return False

    def _conclude(
        self, job: str, incident_id: str, first_seen: float, mine: Mine | None = None
    ) -> None:
        where = self.store.incident_dir(job, incident_id)

        def announce(jv: JobVerdict) -> None:
            log.warning(
                "job verdict for %s: culprit rank %s on node %s (%s), %d nodes reported, in %s",
                jv.incident_id, jv.culprit, jv.culprit_node or "?", jv.basis, jv.reports, where,
            )  # fmt: skip

        try:
            lost = self._lost_peers(mine)
            self.store.wait_and_conclude(job, incident_id, first_seen, announce, lost)
        except (OSError, UntrustedInput) as e:
            log.error("could not write the job verdict under %s: %s", self.store.root, e)

    def _lost_peers(self, mine: Mine | None = None) -> tuple[LostNode, ...]:
        """The peers whose agents went silent, probed until each answers or is lost (at most
        `lost_after` + PEER_SLACK): a whole node lost kills the ranks of the others (their
        deaths then come first-hand from nodes that are still there), or leaves them waiting
        for ranks no view holds."""
        if self.peers is None:
            return ()
        started = time.time()
        while True:
            try:
                looks = self.peers()
            except Exception:  # the probes are the replication's: their failure is logged
                log.exception("cannot probe the peers' agents for the job verdict")
                return ()
            now = time.time()
            s = judge(
                looks, now=now, lost_after=self.lost_after, started=started, slack=PEER_SLACK,
                ranks_since=mine.since_wall if mine is not None else None,
                first_sign=mine.first_sign_wall if mine is not None else None,
            )  # fmt: skip
            if s.wait_until is None:
                for n in s.lost:
                    if n.came_back_at is not None:
                        log.warning("node %s was lost and came back: its agent started %.1f s "
                                    "before this node's ranks failed (ranks %s)", n.node,
                                    mine.first_sign_wall - n.came_back_at if mine else 0.0,
                                    list(n.ranks))  # fmt: skip
                        continue
                    log.warning("node %s went silent: its agent has not answered for %.1f s "
                                "(ranks %s)", n.node, n.silent_for, list(n.ranks))  # fmt: skip
                return s.lost
            time.sleep(max(0.05, min(self.store.poll, s.wait_until - now)))
