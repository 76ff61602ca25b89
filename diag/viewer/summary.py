"""`summary.txt` and `summary.json`: the equivalence classes and suspects of a merge, in words."""

from __future__ import annotations

from dataclasses import dataclass, field

from diag.formats.untrusted import printable
from diag.viewer import frdumps as flightrec
from diag.viewer import frsummary, ranksets
from diag.viewer.absent import Absent
from diag.viewer.classes import RankClass, Suspect
from diag.viewer.tree import View

SUMMARY_FORMAT = "diag.merge/1"
TEXT_CLASSES = 20  # classes per view in summary.txt
TEXT_SUSPECTS = 20
TEXT_RANGES = 64  # rank runs per class in summary.txt (summary.json has them all)
JSON_LIMIT = 1000  # classes per view and suspects in summary.json (all ranks stay in the ranges)
VIEW_TITLES = {View.PY: "Python stacks", View.CPP: "native stacks"}


@dataclass(frozen=True)
class ViewReport:
    """One view's output files and what they show."""

    view: View
    svg: str  # file names, in the output directory
    folded: str
    classes: tuple[RankClass, ...]
    frames: int  # nodes in the merged tree
    folded_lines: int


@dataclass(frozen=True)
class MergeReport:
    """The summary of a merge, written as summary.json and shown by the CLI."""

    incident_id: str
    kind: str
    nodes: tuple[str, ...]
    sources: tuple[str, ...]  # the incident directories merged
    detected_at: str
    world_size: int
    dumped: int  # bitset of ranks with a dump
    culprits: tuple[int, ...]
    verdict_summaries: tuple[str, ...]
    formats: tuple[tuple[str, int], ...]  # dump format -> files
    states: tuple[tuple[str, int], ...]  # process state -> bitset of ranks
    errors: tuple[tuple[int, str], ...]  # rank -> why it has no stack
    problems: tuple[str, ...]
    views: tuple[ViewReport, ...]
    suspects: tuple[Suspect, ...]
    absent: Absent
    flight: flightrec.FlightReport | None = None  # torch's flight recorder, beside the stacks
    numbering: frsummary.Numbering = field(default_factory=frsummary.Numbering)  # as the journal

    @property
    def missing(self) -> int:
        return ((1 << self.world_size) - 1) & ~self.dumped


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _class_json(c: RankClass) -> dict:
    out: dict = {
        "index": c.index,
        "size": c.size,
        "ranks": c.ranks,
        "suspect": c.suspect,
        "minority_score": c.score,  # the class's; its ranks' suspect scores are in "suspects"
        "thread": c.thread,
        "leaf": c.leaf,
        "stack": list(c.tail),
    }
    if c.divergence is not None:
        d = c.divergence
        out["diverges"] = {
            "from_class": d.reference,
            "thread": d.thread,
            "after": d.after,
            "here": d.here,
            "there": d.there,
        }
    return out


def to_json(r: MergeReport) -> dict:
    suspect_bits = ranksets.bits_of(s.rank for s in r.suspects)
    return {
        "format": SUMMARY_FORMAT,
        "incident_id": r.incident_id,
        "kind": r.kind,
        "nodes": list(r.nodes),
        "sources": list(r.sources),
        "detected_at": r.detected_at,
        "world_size": r.world_size,
        "ranks_dumped": ranksets.fold(r.dumped),
        "ranks_missing": ranksets.fold(r.missing),
        "culprits": list(r.culprits),
        "verdict_summaries": list(r.verdict_summaries),
        "dump_formats": dict(r.formats),
        "process_states": {state: ranksets.fold(bits) for state, bits in r.states},
        "errors": [{"rank": rank, "error": e} for rank, e in r.errors[:JSON_LIMIT]],
        "problems": list(r.problems),
        "silent_ranks": ranksets.fold(r.absent.bits),
        "silent_nodes": [{"node": n.index, "ranks": n.ranks} for n in r.absent.nodes],
        "local_world_size": r.absent.local_world_size,
        "suspect_ranks": ranksets.fold(suspect_bits),
        "suspects": [
            {"rank": s.rank, "score": s.score, "reasons": list(s.reasons)}
            for s in r.suspects[:JSON_LIMIT]
        ],
        "views": {
            v.view.value: {
                "svg": v.svg,
                "folded": v.folded,
                "frames": v.frames,
                "folded_lines": v.folded_lines,
                "class_count": len(v.classes),
                "classes": [_class_json(c) for c in v.classes[:JSON_LIMIT]],
            }
            for v in r.views
        },
        "flight_recorder": frsummary.to_json(r.flight, r.numbering) if r.flight else None,
    }


def _class_lines(c: RankClass) -> list[str]:
    flag = "   SUSPECT" if c.suspect else ""  # its ranks' scores: in SUSPECTS, once
    ranks = ranksets.fold(c.bits, TEXT_RANGES)
    lines = [f"  class {c.index}: {_plural(c.size, 'rank')} {ranks}{flag}"]
    if c.thread == c.leaf:  # a marker: the rank has no stack in this view
        lines.append(f"      no stack: {c.leaf}")
        return lines
    d = c.divergence
    if d is not None and c.index > 1:
        where = f"after {d.after}" if d.after else "at the root"
        lines.append(f"      parts from class {d.reference} in {d.thread} {where}")
        lines.append(f"        here:     {d.here}")
        lines.append(f"        class {d.reference}:  {d.there}")
    lines.append(f"      {c.thread} at {c.leaf}")
    if c.index > 1 and c.tail:
        lines.append("      its own frames, outermost first:")
        lines.extend(f"        {t}" for t in c.tail)
    return lines


def to_text(r: MergeReport) -> str:
    out = [f"diag merge: incident {r.incident_id}" + (f" ({r.kind})" if r.kind else "")]
    if r.nodes:
        out.append(f"nodes: {', '.join(r.nodes)}")
    if r.detected_at:
        out.append(f"detected at: {r.detected_at}")
    out.append(f"sources: {', '.join(r.sources)}")
    n = r.dumped.bit_count()
    out.append(
        f"ranks: {n} of {r.world_size} dumped ({ranksets.fold(r.dumped) or 'none'}); "
        f"missing: {ranksets.fold(r.missing) or 'none'}"
    )
    out.append("dump files: " + ", ".join(f"{k}: {v}" for k, v in r.formats))
    if r.states:
        out.append(
            "process states: "
            + "; ".join(f"{s or 'unknown'}: {ranksets.fold(b)}" for s, b in r.states)
        )
    if r.culprits:
        out.append(f"verdict culprit: rank {', '.join(map(str, r.culprits))}")
    out.extend(f"verdict: {s}" for s in r.verdict_summaries if s)
    out.extend(f"note: {p}" for p in r.problems)
    for rank, e in r.errors[:TEXT_SUSPECTS]:
        out.append(f"rank {rank}: no stack: {e}")
    if r.absent.bits:
        silent = r.absent.bits.bit_count()
        nodes = ", ".join(n.label for n in r.absent.nodes)
        out.append(
            f"did not answer: {_plural(silent, 'rank')} {ranksets.fold(r.absent.bits, TEXT_RANGES)}"
            + (f"; whole nodes: {nodes}" if nodes else "")
        )
    out.append("")
    if r.suspects:
        out.append("SUSPECTS, best first:")
        for s in r.suspects[:TEXT_SUSPECTS]:
            out.append(f"  rank {s.rank:<6} score {s.score:.2f}  {'; '.join(s.reasons)}")
        if len(r.suspects) > TEXT_SUSPECTS:
            out.append(f"  ... {len(r.suspects) - TEXT_SUSPECTS} more in summary.json")
    else:
        out.append("SUSPECTS: none (no minority class of stacks, no culprit named)")
    if r.flight is not None and not r.flight.empty:
        out.append("")
        out.extend(frsummary.to_lines(r.flight, r.numbering))
    for v in r.views:
        out.append("")
        out.append(
            f"{VIEW_TITLES[v.view]} ({v.svg}, {v.folded}): "
            f"{_plural(len(v.classes), 'class').replace('classs', 'classes')} of identical stacks"
        )
        for c in v.classes[:TEXT_CLASSES]:
            out.extend(_class_lines(c))
        if len(v.classes) > TEXT_CLASSES:
            out.append(f"  ... {len(v.classes) - TEXT_CLASSES} more classes in summary.json")
    # Every name was cleaned when read; this pass keeps the promise for whatever reaches a
    # terminal through this text (it is a few KB).
    return printable("\n".join(out)) + "\n"
