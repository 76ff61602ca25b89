"""`merge_incident`: an incident's per-rank dumps in, flame SVGs, folded stacks and a summary out.

The entry point for `diag merge` and for anything else (the demo) that wants the picture of an
incident. Reading and writing files happens here; the merging itself lives in analysis.py (on
tree.py, classes.py, flamelayout.py and flame.py), which does no I/O.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from diag.formats.inputcaps import MAX_RANKS_PER_FILE, clean
from diag.formats.stackdump import RankDump
from diag.viewer import frdumps as flightrec
from diag.viewer import frsummary, ranksets
from diag.viewer.absent import Absent, local_world_size
from diag.viewer.analysis import About, analyse, draw
from diag.viewer.classes import RankClass, Suspect
from diag.viewer.flame import FlameSettings
from diag.viewer.folded import write_folded
from diag.viewer.gather import Gathered, gather
from diag.viewer.incidents import Incident, IncidentError, find_incidents, pick_incident
from diag.viewer.journals import journal_local_sizes, read_group_last
from diag.viewer.outputs import OutputDir
from diag.viewer.sources import DumpFile, default_workers
from diag.viewer.summary import MergeReport, ViewReport, to_json, to_text
from diag.viewer.tree import View

log = logging.getLogger(__name__)

SUMMARY_TXT = "summary.txt"
SUMMARY_JSON = "summary.json"

__all__ = ["IncidentError", "MergeResult", "merge_incident"]


@dataclass(frozen=True)
class MergeResult:
    """What `merge_incident` wrote and found."""

    incident_id: str
    out_dir: Path
    sources: tuple[Path, ...]  # the incident directories merged
    world_size: int
    ranks: str  # ranks with a dump, folded
    culprits: tuple[int, ...]
    classes: dict[View, tuple[RankClass, ...]]
    suspects: tuple[Suspect, ...]  # best first
    absent: Absent  # ranks that did not answer, and whole nodes of them
    svgs: dict[View, Path]
    folded: dict[View, Path]
    summary_txt: Path
    summary_json: Path
    report: MergeReport
    seconds: dict[str, float]  # wall time per stage: read, merge, draw, write

    @property
    def py_svg(self) -> Path:
        return self.svgs[View.PY]

    @property
    def cpp_svg(self) -> Path:
        return self.svgs[View.CPP]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "incident"


def incident_files(inc: Incident) -> list[DumpFile]:
    """The dump files of one incident, checked to be of one run: one world size, each rank
    once."""
    worlds: dict[int, Path] = {}
    files: list[DumpFile] = []
    for d in inc.dirs:
        if d.verdict is not None and d.verdict.world_size:
            worlds.setdefault(d.verdict.world_size, d.path / "verdict.json")
        for f in d.dumps:
            if f.world_size not in worlds:
                worlds[f.world_size] = f.path
            files.append(f)
    if len(worlds) > 1:
        seen = "; ".join(f"{w} in {p}" for w, p in sorted(worlds.items()))
        raise IncidentError(
            f"the files of incident {inc.incident_id} disagree on the world size ({seen}): they "
            "come from different runs; point --path at one incident directory"
        )
    seen_at: dict[int, DumpFile] = {}
    for f in files:
        if f.rank in seen_at:
            raise IncidentError(
                f"rank {f.rank} has two dumps in incident {inc.incident_id}: {seen_at[f.rank].path}"
                f" and {f.path}; remove the stale one or merge the directories one at a time"
            )
        seen_at[f.rank] = f
    return files


def _world(inc: Incident, files: list[DumpFile]) -> tuple[int, str]:
    """The world size the verdict or the file names give, believed up to MAX_RANKS_PER_FILE
    ranks per dump file found; above that, the highest rank found + 1 (and a note saying so),
    so that no name makes the merge spend memory or time on ranks nobody dumped."""
    claimed = next(
        (d.verdict.world_size for d in inc.dirs if d.verdict is not None and d.verdict.world_size),
        files[0].world_size,
    )
    found = max(f.rank for f in files) + 1
    if claimed <= max(found, len(files) * MAX_RANKS_PER_FILE):
        return claimed, ""
    note = (
        f"the world size {claimed} named by the verdict or the file names is not believed with "
        f"{len(files)} dump file{'s' if len(files) > 1 else ''} (more than {MAX_RANKS_PER_FILE} "
        f"ranks per file); merged as a world of {found}, the highest rank found + 1"
    )
    log.warning("incident %s: %s", inc.incident_id, note)
    return found, note


def _check(inc: Incident, dumps: list[RankDump], world: int) -> None:
    if not dumps:
        problems = [p for d in inc.dirs for p in d.problems]
        why = f" ({'; '.join(problems[:3])})" if problems else ""
        raise IncidentError(
            f"incident {inc.incident_id} ({', '.join(clean(str(d.path)) for d in inc.dirs)}) has "
            f"no readable dump file{why}"
        )
    bad = [d.rank for d in dumps if d.rank >= world]
    if bad:
        raise IncidentError(f"rank {bad[0]} is out of range for world size {world}")


def _out_dir(inc: Incident, path: Path) -> tuple[Path, tuple[str, ...], bool]:
    """Where the outputs go, as (a directory the user named, the names beneath it, whether to
    make them): an incident's own directory, or `merged-<id>` beside several."""
    if len(inc.dirs) == 1:
        d = inc.dirs[0].path
        return (d, (), False) if d == path else (d.parent, (d.name,), False)
    root = Path(os.path.commonpath([str(d.path) for d in inc.dirs]))
    return root, (f"merged-{_safe(inc.incident_id)}",), True


def _local_size(dumps: list[RankDump], inc: Incident, given: int | None) -> int | None:
    if given:
        return given
    return local_world_size(dumps, journal_local_sizes(d.path for d in inc.dirs))


def merge_incident(
    path: Path,
    *,
    incident: str | None = None,
    out_dir: Path | None = None,
    flame: FlameSettings | None = None,
    workers: int | None = None,
    local_world_size: int | None = None,
) -> MergeResult:
    """Merges the newest incident at `path` (or the one named `incident`) and writes
    py_stack.svg, cpp_stack.svg, py_stack.folded, cpp_stack.folded, summary.txt and
    summary.json into its directory (`out_dir` to write elsewhere). Several nodes' directories
    of one incident are written to `merged-<incident id>` beside them. `workers`: processes
    that parse dump files when there are thousands (default: one per CPU, at most 8).
    `local_world_size`: ranks per node, to name nodes none of whose ranks answered, when
    neither the dumps nor the journals say it.
    Raises IncidentError when the path holds nothing to merge or mixes runs."""
    path = Path(path)
    t0 = time.perf_counter()
    inc = pick_incident(find_incidents(path), incident, path)
    files = incident_files(inc)
    got = gather(files, default_workers() if workers is None else workers)
    dumps = got.dumps
    world, world_note = _world(inc, files) if files else (0, "")
    _check(inc, dumps, world)
    t1 = time.perf_counter()
    if out_dir is not None:
        opened = OutputDir.given(Path(out_dir))
    else:
        base, parts, create = _out_dir(inc, path)
        opened = OutputDir.open(base, parts, create=create)
    with opened as out:
        return _analyse_and_write(inc, got, world, world_note, out, flame, local_world_size, t0, t1)


def _analyse_and_write(
    inc: Incident,
    got: Gathered,
    world: int,
    world_note: str,
    out: OutputDir,
    flame: FlameSettings | None,
    local_world_size: int | None,
    t0: float,
    t1: float,
) -> MergeResult:
    """The analysis of what was read, its pictures, folded stacks and summary written into
    `out`."""
    dumps, formats = got.dumps, got.formats
    local = _local_size(dumps, inc, local_world_size)
    result = analyse(got, world, inc.culprits, local)
    dumped, culprits, sus, absent = result.dumped, result.culprits, result.suspects, result.absent
    about = About(inc.incident_id, inc.kind, tuple(inc.nodes))
    t2 = time.perf_counter()

    svgs: dict[View, Path] = {}
    folded: dict[View, Path] = {}
    reports = []
    drawing = 0.0
    for view, tree in result.trees.items():
        folded_name, svg_name = f"{view.value}_stack.folded", f"{view.value}_stack.svg"
        with out.stream(folded_name) as fh:
            lines = write_folded(tree, fh)
        folded[view] = out.path / folded_name
        t = time.perf_counter()
        svg = draw(view, about, result, flame)
        drawing += time.perf_counter() - t
        svgs[view] = out.write(svg_name, svg.encode())
        reports.append(
            ViewReport(
                view=view,
                svg=svg_name,
                folded=folded_name,
                classes=result.classes[view].classes,
                frames=len(tree) - 1,
                folded_lines=lines,
            )
        )

    states: dict[str, int] = {}
    for d in dumps:
        states[d.process_state] = states.get(d.process_state, 0) | (1 << d.rank)
    flight = flightrec.read_incident([d.path for d in inc.dirs], world or flightrec.MAX_RANK)
    report = MergeReport(
        incident_id=inc.incident_id,
        kind=inc.kind,
        nodes=tuple(inc.nodes),
        sources=tuple(clean(str(d.path)) for d in inc.dirs),
        detected_at=min((v.detected_at for v in inc.verdicts if v.detected_at), default=""),
        world_size=world,
        dumped=dumped,
        culprits=culprits,
        verdict_summaries=tuple(v.summary for v in inc.verdicts if v.summary),
        formats=tuple(sorted(formats.items())),
        states=tuple(sorted(states.items())),
        errors=tuple((d.rank, d.error) for d in dumps if d.error),
        problems=(*(p for d in inc.dirs for p in d.problems), *filter(None, [world_note])),
        views=tuple(reports),
        suspects=sus,
        absent=absent,
        flight=flight,
        numbering=frsummary.numbering(
            flight, read_group_last((d.path for d in inc.dirs), {r.rank for r in flight.records})
        ),
    )
    summary_txt = out.write(SUMMARY_TXT, to_text(report).encode())
    summary_json = out.write(SUMMARY_JSON, (json.dumps(to_json(report), indent=1) + "\n").encode())
    t3 = time.perf_counter()
    seconds = {"read": t1 - t0, "merge": t2 - t1, "draw": drawing, "write": t3 - t2 - drawing}
    log.debug(
        "merged incident %s (%d ranks) into %s: %s",
        inc.incident_id,
        len(dumps),
        out.path,
        ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items()),
    )
    return MergeResult(
        incident_id=inc.incident_id,
        out_dir=out.path,
        sources=tuple(d.path for d in inc.dirs),
        world_size=world,
        ranks=ranksets.fold(dumped),
        culprits=culprits,
        classes={v: vc.classes for v, vc in result.classes.items()},
        suspects=sus,
        absent=absent,
        svgs=svgs,
        folded=folded,
        summary_txt=summary_txt,
        summary_json=summary_json,
        report=report,
        seconds=seconds,
    )
