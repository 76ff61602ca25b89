"""Which dumps belong together: incident directories and how to find them.

An incident directory (one per node per incident) holds a `verdict.json` and the node's dump
files. Directories of several nodes belong to one incident when their verdicts share an
`incident_id`; a directory without a verdict (xpu_timer's timeline directory, a folder of py-spy
files) is an incident of its own, named after the directory. A path given to `diag merge` is
either an incident directory (it holds dump files or a verdict) or a root whose subdirectories
are incident directories; dump files lying directly in a root form one more incident.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from diag.formats.incidentdir import IncidentDir, Verdict, has_verdict, name_time, read_verdict
from diag.formats.inputcaps import clean
from diag.viewer.sources import DumpFile, has_dumps, scan

log = logging.getLogger(__name__)

_EPOCH = datetime.fromtimestamp(0, tz=UTC)


class IncidentError(ValueError):
    """The path does not hold what the merge needs; the message says what to do."""


@dataclass(frozen=True)
class Incident:
    """An incident: the directories, one per node, that share its id."""

    incident_id: str
    dirs: tuple[IncidentDir[DumpFile], ...]
    when: datetime = field(default=_EPOCH)

    @property
    def verdicts(self) -> list[Verdict]:
        return [d.verdict for d in self.dirs if d.verdict is not None]

    @property
    def kind(self) -> str:
        return next((v.kind for v in self.verdicts if v.kind), "")

    @property
    def nodes(self) -> list[str]:
        return sorted({v.node for v in self.verdicts if v.node})

    @property
    def culprits(self) -> list[int]:
        return sorted({v.culprit for v in self.verdicts if v.culprit is not None})

    @property
    def n_dumps(self) -> int:
        return sum(len(d.dumps) for d in self.dirs)


def _parse_time(text: str) -> datetime | None:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _when(d: IncidentDir[DumpFile]) -> datetime:
    if d.verdict is not None:
        t = _parse_time(d.verdict.detected_at)
        if t is not None:
            return t
    t = name_time(d.path.name)
    if t is not None:
        return t
    mtimes = []
    for f in d.dumps:
        try:
            mtimes.append(os.stat(os.path.join(f.directory, f.name)).st_mtime)
        except OSError:
            continue
    return datetime.fromtimestamp(max(mtimes), tz=UTC) if mtimes else _EPOCH


def read_dir(path: Path) -> IncidentDir[DumpFile]:
    verdict, problems = read_verdict(path)
    for problem in problems:
        log.warning("%s", problem)
    found = scan(path)
    return IncidentDir(
        path=path,
        verdict=verdict,
        dumps=found.files,
        problems=(*problems, *found.problems(path)),
    )


def is_incident_dir(path: Path) -> bool:
    return has_verdict(path) or has_dumps(path)


def _group(dirs: list[IncidentDir[DumpFile]]) -> list[Incident]:
    by_id: dict[str, list[IncidentDir[DumpFile]]] = {}
    for d in dirs:
        key = d.verdict.incident_id if d.verdict is not None else f"dir:{d.path}"
        by_id.setdefault(key, []).append(d)
    out = []
    for key, members in by_id.items():
        members.sort(key=lambda d: d.path.name)
        incident_id = key if not key.startswith("dir:") else clean(members[0].path.name)
        out.append(Incident(incident_id, tuple(members), max(_when(d) for d in members)))
    out.sort(key=lambda i: (i.when, i.incident_id), reverse=True)
    return out


def find_incidents(path: Path) -> list[Incident]:
    """The incidents at `path`, newest first."""
    if not path.is_dir():
        raise IncidentError(
            f"{path} is not a directory; give an incident directory or a timeline root"
        )
    if has_verdict(path):
        return _group([read_dir(path)])
    dirs = []
    if has_dumps(path):
        dirs.append(read_dir(path))
    try:
        entries = list(os.scandir(path))
    except OSError as e:
        raise IncidentError(f"cannot list {path}: {e}") from e
    # A symlinked directory is not followed: in a timeline others can write, it could lead the
    # merge to read, and write its outputs, anywhere.
    links = sorted(clean(e.name) for e in entries if e.is_symlink() and e.is_dir())
    if links:
        log.warning(
            "%s: symlinked directories not followed: %s", clean(str(path)), ", ".join(links)
        )
    subdirs = sorted(e.path for e in entries if e.is_dir(follow_symlinks=False))
    dirs.extend(read_dir(Path(s)) for s in subdirs if is_incident_dir(Path(s)))
    return _group(dirs)


def pick_incident(incidents: list[Incident], wanted: str | None, path: Path) -> Incident:
    """The newest incident, or the one whose id or directory name is `wanted`."""
    if not incidents:
        raise IncidentError(
            f"no incident under {path}: expected dump files ({{rank}}-{{world}}.stack.json, "
            ".stacktrace or py-spy .json) or a verdict.json, there or in its subdirectories"
        )
    if wanted is None:
        return incidents[0]
    for inc in incidents:
        if wanted == inc.incident_id or any(wanted == d.path.name for d in inc.dirs):
            return inc
    known = ", ".join(i.incident_id for i in incidents[:10])
    raise IncidentError(f"no incident {wanted!r} under {path}; there are: {known}")
