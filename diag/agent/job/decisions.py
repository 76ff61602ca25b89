"""The job verdict's decisions, pure: which incident of the job a node's incident belongs to,
whether the node files a report for it, and the culprit from the reports filed.

The file adapter (`verdict.py`) lists and reads; the node's side (`link.py`) runs the
steps at their times. Nothing here touches a file or a clock: times come in as arguments.

Incident ids are the decision core's (`hang.py`): `<era>-<kind>-...`, the era being the
launcher's attempt and the world's generation when it formed again in place (`a3`, `a3g1`). A
death has one id per era (`a3-rank_exited`), so every node whose ranks die in one cascade lands
in the same incident whatever order their agents see it in. An id seen again in a later run of the
job (a pod restart starts again at attempt 0) gets a generation, `<id>~2`, `<id>~3`...: an
incident whose claim is older than the node's ranks belongs to an earlier run.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Any

from diag.agent.job.nodeview import MAX_RANKS
from diag.formats.refusals import printable

JOB_VERDICT_FORMAT = "diag.job-verdict/1"
DEATH = "rank_exited"  # the decision core's kind for a rank that died
# Clocks of the nodes (and of the file server that stamps files) agree to well within this.
CLOCK_SKEW = 2.0
# A later run of the job (pods restarted: attempts count from 0 again) attaches its ranks at
# least this long after the earlier run's last incident: restart, imports, rendezvous.
RUN_GAP = 10.0


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
    first_sign_wall: float = 0.0  # when its first rank died (deaths), else its verdict's time

    def name(self) -> str:
        rank = "x" if self.culprit is None else str(self.culprit)
        # The evidence directory's own name rides along, so one listing gives every node's.
        evidence = safe_name(self.evidence.rstrip("/").rsplit("/", 1)[-1])
        return f"r{rank}.{self.where.value}.{safe_name(self.node)[:63]}~{evidence}"


@dataclass(frozen=True)
class ReportName:
    """What a report's file name says, without reading it."""

    node: str
    culprit: int | None
    where: Where
    file: str
    evidence_name: str = ""


_NAME = re.compile(r"^r(x|\d+)\.([LR])\.([A-Za-z0-9_.-]+)~([A-Za-z0-9_.@-]*)$")


def parse_name(name: str) -> ReportName | None:
    """What a file name in the reports directory says; None when it is not a report's name
    (or names a rank no job has, or an evidence directory that is not a plain name)."""
    m = _NAME.match(name)
    if m is None or m.group(4) in ("", ".", ".."):
        return None
    if m.group(1) != "x" and (len(m.group(1)) > 7 or int(m.group(1)) >= MAX_RANKS):
        return None
    rank = None if m.group(1) == "x" else int(m.group(1))
    return ReportName(
        node=m.group(3), culprit=rank, where=Where(m.group(2)), file=name, evidence_name=m.group(4)
    )


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", text)[:160] or "node"


@dataclass(frozen=True)
class JobVerdict:
    incident_id: str
    job: str
    culprit: int | None
    culprit_node: str  # "" when no node reported the culprit as its own
    basis: str  # why this rank: first-hand, or the most nodes' opinion
    nodes: tuple[str, ...]  # the nodes whose reports it names: first-hand ones, the culprit's
    evidence: tuple[str, ...]  # their incident directories, in the order of `nodes`
    first_hand: NodeReport | None
    decided_wall: float
    # Every node's incident directory of this incident, those of nodes that filed nothing
    # included: one listing of the timeline (incident.py names them after the incident).
    evidence_glob: str = ""
    reports: int = 0  # how many nodes filed a report
    # Nodes whose agents went silent as their ranks vanished (silence.py): the culprit is the
    # first; a death first-hand elsewhere was their victim, and no survivor counts against.
    lost_nodes: tuple[str, ...] = ()


# -- which incident, and whether to file ---------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """What a claim file says: who claimed the incident, and whether first-hand."""

    node: str
    where: Where
    culprit: int | None
    first_sign_wall: float

    def text(self) -> str:
        rank = "x" if self.culprit is None else str(self.culprit)
        return f"{self.node} {self.where.value} {rank} {self.first_sign_wall:.3f}\n"

    @classmethod
    def parse(cls, text: str) -> Claim | None:
        """None for what is not a claim: one from an older agent (the node name only), a torn
        one, or one with a rank or time out of bounds."""
        parts = text.split()
        if len(parts) != 4 or parts[1] not in ("L", "R") or len(parts[0]) > 256:
            return None
        try:
            rank = None if parts[2] == "x" else int(parts[2])
            wall = float(parts[3])
        except ValueError:
            return None
        if (rank is not None and not 0 <= rank < MAX_RANKS) or not math.isfinite(wall):
            return None
        return cls(printable(parts[0]), Where(parts[1]), rank, wall)


@dataclass(frozen=True)
class Known:
    """One incident of the job as a listing of the job's directory and its claim show it."""

    incident_id: str
    claimed_wall: float  # the claim's time (its file's mtime), or the directory's
    claim: Claim | None = None
    # Looked at only when it matters (a waiting node at its second look):
    verdict: bool = False  # job-verdict.json is in place
    marked: bool = False  # a first-hand report came after a waiting node's claim

    @property
    def first_hand(self) -> bool:
        return self.marked or (self.claim is not None and self.claim.where == Where.LOCAL)


@dataclass(frozen=True)
class Mine:
    """This node's incident, as its own verdict has it."""

    incident_id: str  # the decision core's id, no generation
    where: Where
    first_sign_wall: float  # its first rank's death, or its verdict's time
    decided_wall: float
    since_wall: float  # its ranks started then: incidents claimed before are an earlier run's

    @property
    def death(self) -> bool:
        return kind_of(self.incident_id) == DEATH

    @property
    def attempt(self) -> int | None:
        return attempt_of(self.incident_id)

    @property
    def era(self) -> tuple[int, int] | None:
        return era_of(self.incident_id)


@dataclass(frozen=True)
class Target:
    """The incident this node's incident belongs to."""

    incident_id: str  # with its generation
    known: Known | None  # None: nobody filed it yet
    adopted: bool  # another incident than the one this node's verdict named
    consequence: bool  # explained by what another node saw first: this node files nothing
    reason: str


_ID = re.compile(r"^a(\d+)(?:g(\d+))?-([a-z_]+)")


def generation(incident_id: str) -> tuple[str, int]:
    base, sep, gen = incident_id.rpartition("~")
    if sep and gen.isdigit():
        return base, int(gen)
    return incident_id, 1


def with_generation(base: str, gen: int) -> str:
    return base if gen <= 1 else f"{base}~{gen}"


def attempt_of(incident_id: str) -> int | None:
    m = _ID.match(incident_id)
    return int(m.group(1)) if m else None


def era_of(incident_id: str) -> tuple[int, int] | None:
    """(attempt, world generation): a fault of one era does not explain one of another."""
    m = _ID.match(incident_id)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def kind_of(incident_id: str) -> str:
    m = _ID.match(incident_id)
    return m.group(3) if m else ""


def fresh(claimed_wall: float, since_wall: float) -> bool:
    """Claimed in this run of the job, not an earlier one's."""
    return claimed_wall >= since_wall - RUN_GAP


def _fresh(k: Known, mine: Mine) -> bool:
    return fresh(k.claimed_wall, mine.since_wall)


def own_incident(mine: Mine, known: list[Known]) -> tuple[str, Known | None]:
    """This node's own id with its generation: the newest one, unless an earlier run claimed it
    (then the next)."""
    gens = [(generation(k.incident_id)[1], k) for k in known]
    gens = [(g, k) for g, k in gens if generation(k.incident_id)[0] == mine.incident_id]
    if not gens:
        return mine.incident_id, None
    g, k = max(gens, key=lambda gk: gk[0])
    if _fresh(k, mine):
        return k.incident_id, k
    return with_generation(mine.incident_id, g + 1), None


def choose(mine: Mine, known: list[Known], window: float) -> Target:
    """The incident this node's incident is part of, from the job's incidents `known` (one
    listing). In one era of the job (an attempt, or a world formed again in place within it):
    - a death explains everything after it (a dead rank does not come back in that era: a spare
      that takes its place joins the next world): an incident of this node that comes later
      joins it, and files nothing;
    - a node that only waits for ranks elsewhere joins an incident of the attempt that another
      node claimed within `window` seconds before (a first-hand one first), rather than opening
      a second one for the same stall;
    - otherwise the node's own id, in the current generation."""
    own_id, own = own_incident(mine, known)
    current = [
        k for k in known
        if _fresh(k, mine) and era_of(k.incident_id) == mine.era
        and k.incident_id != own_id
    ]  # fmt: skip
    if mine.death:
        # Deaths share the id: ours is a consequence when the one claimed came first.
        lead = own.claim if own is not None else None
        later = lead is not None and lead.first_sign_wall <= mine.first_sign_wall
        return Target(
            own_id, own, adopted=False, consequence=later, reason=_after(lead) if later else ""
        )
    deaths = sorted(
        (k for k in current if kind_of(k.incident_id) == DEATH),
        key=lambda k: k.claimed_wall,
    )
    deaths = [k for k in deaths if k.claimed_wall <= mine.decided_wall + CLOCK_SKEW]
    if deaths:
        k = deaths[0]
        return Target(k.incident_id, k, adopted=True, consequence=True, reason=_after(k.claim))
    if mine.where == Where.LOCAL:
        return Target(own_id, own, adopted=False, consequence=False, reason="")
    if own is not None and own.first_hand:
        return Target(own_id, own, adopted=False, consequence=True, reason=_after(own.claim))
    near = [k for k in current if k.claimed_wall >= mine.decided_wall - window]
    near.sort(key=lambda k: (not k.first_hand, k.claimed_wall, k.incident_id))
    if near and (own is None or near[0].first_hand):
        k = near[0]
        return Target(
            k.incident_id, k, adopted=True, consequence=k.first_hand,
            reason=_after(k.claim) if k.first_hand else "",
        )  # fmt: skip
    return Target(own_id, own, adopted=False, consequence=False, reason="")


def _after(claim: Claim | None) -> str:
    if claim is None:
        return "another node reported it first"
    rank = "" if claim.culprit is None else f"rank {claim.culprit} on "
    how = "first-hand" if claim.where == Where.LOCAL else "from its view"
    return f"{rank}node {claim.node} reported it first ({how})"


class Filing(enum.Enum):
    NOW = "now"  # a first-hand report: file at once
    WAIT = "wait"  # look again a moment later (`view_after`), then file a view or not
    NONE = "none"  # someone else's report covers it


def filing(mine: Mine, target: Target, *, settled: bool) -> Filing:
    """Whether this node files its report. First-hand reports go at once. A node that only
    waits for ranks elsewhere files nothing while a first-hand report or a verdict covers the
    incident; at its second look (`settled`, a moment after its verdict) it files its view only
    if none does (the culprit's node saw nothing, or its agent is gone), or if others are filing
    theirs for want of one; the claimant of views still waits the settle time out."""
    if target.consequence:
        return Filing.NONE
    if mine.where == Where.LOCAL:
        return Filing.NOW  # a verdict already in place takes it in late (add_late_reports)
    if target.known is not None and (target.known.verdict or target.known.first_hand):
        return Filing.NONE
    if not settled:
        return Filing.WAIT
    return Filing.NOW


def as_consequence(summary: str, target: Target) -> str:
    why = f": {target.reason}" if target.reason else ""
    return f"{summary} (part of job incident {target.incident_id}{why})"
