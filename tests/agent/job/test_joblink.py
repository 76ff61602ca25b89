"""A node's side of the job verdict with the real decision core, the real file store on a
directory and real incident directories (`capture`): a death on one node, the hang it causes on
others, one job incident and one job verdict."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

from diag.agent.detect.hang import Policy, Verdict, VerdictKind, WatchState, decide
from diag.agent.detect.observation import Liveness, Observation, OpView, RankSnapshot
from diag.agent.detect.timeouts import TimeoutPolicy
from diag.agent.evidence.collection import IncidentReport, capture, verdict_document
from diag.agent.job.link import JobLink, job_incident_id
from diag.agent.job.nodeview import view_document
from diag.agent.job.verdict import JOB_VERDICT_FILE, JobVerdictStore
from diag.formats.records import OpCode, OpState

JOB = "j"
POLICY = Policy(timeouts=TimeoutPolicy(floor=2.0, ceiling=30.0))


def _rank(r: int, node: str, now: float, *, dead: bool = False) -> RankSnapshot:
    stuck = OpView("0", 42, OpCode.ALL_REDUCE, OpState.ENQUEUED, 64, now - 10)
    return RankSnapshot(
        rank=r, local_rank=r % 2, pid=100 + r, node=node,
        liveness=Liveness.DIED if dead else Liveness.RUNNING, started_at=now - 100,
        last_activity=now - 10, step=7, pending=() if dead else (stuck,),
        last_ops={"0": stuck}, step_durations=(0.5,), exited_at=now - 0.2 if dead else None,
    )  # fmt: skip


def _obs(now: float, *ranks: RankSnapshot) -> Observation:
    return Observation(
        now=now, ranks=ranks, groups={"0": (0, 1, 2, 3, 4, 5)}, world_size=6, job=JOB
    )


def _incident(
    link: JobLink, timeline: Path, node: str, obs: Observation
) -> tuple[Verdict, IncidentReport]:
    """What the agent does at a verdict: resolve it under the job's incident, capture (here with
    no ranks to dump), and hand the directory over once on disk."""
    verdict = decide(WatchState(), obs, POLICY).verdict
    assert verdict is not None
    verdict = link.resolve(verdict, obs, JOB, time.time())
    doc = verdict_document(
        verdict, kind=verdict.kind.value, incident_id=job_incident_id(JOB, verdict.incident_id),
        job=JOB, node=node, world_size=6, detected_at=dt.datetime.now(dt.UTC),
        summary=verdict.summary,
    )  # fmt: skip
    seen: list[IncidentReport] = []
    result = capture(
        [], timeline, doc, native=False,
        on_disk=lambda early: seen.append(IncidentReport(verdict, early, JOB, node)),
    )  # fmt: skip
    report = IncidentReport(verdict, result, JOB, node)
    link.on_disk(seen[0], view_document(obs, node, time.time()))
    link.captured(report)
    return verdict, report


def test_a_hang_after_a_death_elsewhere_is_part_of_its_incident(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline"
    store = JobVerdictStore(timeline / ".jobs", settle=1.0, poll=0.05, cascade=0.2)
    links = {n: JobLink(JobVerdictStore(store.root, settle=1.0, poll=0.05, cascade=0.2), n)
             for n in ("node-a", "node-b", "node-c")}  # fmt: skip
    now = 500.0
    # node-c's ranks hang first (its agent looked before the death was filed): it waits.
    c, c_report = _incident(
        links["node-c"], timeline, "node-c", _obs(now, _rank(4, "node-c", now), _rank(5, "node-c", now))
    )  # fmt: skip
    assert c.kind == VerdictKind.HANG and c.incident_id == "a0-hang-pg0-seq42"
    # Rank 1 died on node-a: first-hand, filed at once.
    a, _ = _incident(
        links["node-a"], timeline, "node-a",
        _obs(now, _rank(0, "node-a", now), _rank(1, "node-a", now, dead=True)),
    )  # fmt: skip
    assert (a.kind, a.incident_id, a.culprit) == (VerdictKind.RANK_EXITED, "a0-rank_exited", 1)
    # node-b's ranks, waiting for rank 1, hang later: part of the death's incident, no report.
    b, b_report = _incident(
        links["node-b"], timeline, "node-b", _obs(now, _rank(2, "node-b", now), _rank(3, "node-b", now))
    )  # fmt: skip
    assert (b.kind, b.incident_id, b.culprit) == (VerdictKind.HANG, "a0-rank_exited", None)
    assert "part of job incident a0-rank_exited: rank 1 on node node-a reported it first" in (
        b.summary
    )
    assert b_report.evidence is not None
    assert b_report.evidence.path.name.endswith("@j-a0-rank_exited")
    for link in links.values():
        link.join(timeout=30)

    # One job incident, one verdict: rank 1 on node-a, from node-a's report only.
    incidents = sorted(p.name for p in (timeline / ".jobs" / JOB).iterdir())
    assert incidents == ["a0-rank_exited"], incidents
    v = store.load(JOB, "a0-rank_exited")
    assert v is not None and (v.culprit, v.culprit_node, v.reports) == (1, "node-a", 1)
    # node-c found the death at the end of its settle time: its directory moved into the
    # incident (its verdict.json, which `diag merge` groups by) and it filed nothing.
    assert c_report.evidence is not None
    moved = json.loads((c_report.evidence.path / "verdict.json").read_text())
    assert moved["incident_id"] == "j-a0-rank_exited"
    assert moved["own_incident_id"] == "j-a0-hang-pg0-seq42"
    # Every node's directory from the verdict: a and b by their names (c kept its first name).
    assert sorted(p.name[p.name.index("node-") :] for p in store.evidence_dirs(v)) == [
        "node-a@j-a0-rank_exited", "node-b@j-a0-rank_exited",
    ]  # fmt: skip
    assert (timeline / ".jobs" / JOB / "a0-rank_exited" / JOB_VERDICT_FILE).is_file()


def test_a_waiting_node_files_its_view_when_nobody_knows_first_hand(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline"
    link = JobLink(JobVerdictStore(timeline / ".jobs", settle=0.5, poll=0.05), "node-c")
    now = 500.0
    c, _ = _incident(link, timeline, "node-c", _obs(now, _rank(4, "node-c", now)))
    assert c.incident_id == "a0-hang-pg0-seq42" and c.culprit is None
    assert not (timeline / ".jobs").exists()  # nothing filed before the settle time
    link.join(timeout=30)
    reports = list((timeline / ".jobs" / JOB / "a0-hang-pg0-seq42" / "reports").iterdir())
    assert [p.name.split("~")[0] for p in reports] == ["rx.R.node-c"]
    assert json.loads(reports[0].read_text())["view"]["node"] == "node-c"
    v = JobVerdictStore(timeline / ".jobs").load(JOB, "a0-hang-pg0-seq42")
    assert v is not None and v.reports == 1 and v.culprit is None
    assert "no report carries" in v.basis or "no node named" in v.basis
