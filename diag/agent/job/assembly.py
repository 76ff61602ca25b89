"""The claimant's side of the job verdict, pure: when the reports filed are enough, which rank
they name as the culprit (first-hand first), and the verdict assembled from them. Which
incident a node's report belongs to, and whether it files one, is decisions.py's."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from diag.agent.job.decisions import JobVerdict, NodeReport, ReportName, Where


def ready(
    names: list[ReportName],
    first_seen: float,
    now: float,
    settle: float,
    *,
    cascade: float = 0.0,
) -> bool:
    """The verdict can be assembled once a node has reported the culprit as its own rank (for a
    death, `cascade` seconds after the first report, so that an earlier death reported a moment
    later still leads), or `settle` seconds after the first report (a culprit whose node saw
    nothing)."""
    if now - first_seen >= settle:
        return True
    first_hand = any(n.where == Where.LOCAL and n.culprit is not None for n in names)
    return first_hand and now - first_seen >= cascade


def pick_culprit(
    names: list[ReportName], read: dict[str, NodeReport] | None = None
) -> tuple[int | None, str, str]:
    """(rank, node, basis). A node that blames one of its own ranks knows it first-hand (it saw
    the rank die or sit outside the collective); of several, the earliest death, else the rank
    most of them blame; without any, the rank most nodes blame."""
    local = [n for n in names if n.where == Where.LOCAL and n.culprit is not None]
    if local:
        signs = {
            n.file: read[n.file].first_sign_wall
            for n in local
            if read is not None and n.file in read and read[n.file].first_sign_wall > 0
        }
        if len(signs) > 1 and len(signs) == len(local):
            first = min(local, key=lambda n: (signs[n.file], n.culprit, n.node))
            return (
                first.culprit,
                first.node,
                f"first-hand: the culprit's own node blamed it, the first of {len(local)} "
                "nodes whose ranks died",
            )
        count = Counter(n.culprit for n in local)
        rank, _ = max(count.items(), key=lambda kv: (kv[1], -kv[0]))  # type: ignore[operator]
        node = min(n.node for n in local if n.culprit == rank)
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
    evidence_glob: str = "",
    lost_nodes: tuple[str, ...] = (),
) -> JobVerdict:
    """The verdict names the first-hand reports and the culprit's node's, not every node that
    filed (in a fallback, all of them): the rest are found through `evidence_glob`."""
    rank, node, basis = pick if pick is not None else pick_culprit(names, read)
    first = None
    for n in names:
        if n.node == node and n.culprit == rank and n.file in read:
            first = replace(read[n.file], view=None)  # the verdict stays small
            break
    named = {
        n.node: evidence[n.file]
        for n in sorted(names, key=lambda n: (n.node, n.file), reverse=True)
        if n.where == Where.LOCAL or (node and n.node == node)
    }
    nodes = tuple(sorted(named))
    return JobVerdict(
        incident_id=incident_id,
        job=job,
        culprit=rank,
        culprit_node=node,
        basis=basis,
        nodes=nodes,
        evidence=tuple(named[n] for n in nodes),
        first_hand=first,
        decided_wall=now_wall,
        evidence_glob=evidence_glob,
        reports=len({n.node for n in names}),
        lost_nodes=lost_nodes,
    )
