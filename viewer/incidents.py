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

from diag.formats.inputcaps import MAX_WORLD, VERDICT_MAX_BYTES, clean
from diag.formats.untrusted import UntrustedInput, bounded_int, read_json
from diag.viewer.sources import DumpFile, has_dumps, scan

log = logging.getLogger(__name__)

VERDICT_FILE = "verdict.json"
_EPOCH = datetime.fromtimestamp(0, tz=UTC)


class IncidentError(ValueError):
    """The path does not hold what the merge needs; the message says what to do."""


@dataclass(frozen=True)
class Verdict:
    """The fields of `verdict.json` the merge uses; unknown fields are ignored."""

    incident_id: str
    kind: str = ""
    node: str = ""
    job: str = ""
    world_size: int | None = None
    detected_at: str = ""
    culprit: int | None = None
    summary: str = ""

    @classmethod
    def from_dict(cls, raw: object, source: str = VERDICT_FILE) -> Verdict:
        """The verdict in a parsed verdict.json; UntrustedInput (naming `source`) when it is
        none. Text is cleaned of control characters, numbers bounded."""
        if not isinstance(raw, dict) or not raw.get("incident_id"):
            raise UntrustedInput(source, "no incident_id")
        culprit = raw.get("culprit")
        world = raw.get("world_size")

        def text(key: str) -> str:
            return clean(str(raw.get(key) or ""))

        return cls(
            incident_id=text("incident_id"),
            kind=text("kind"),
            node=text("node"),
            job=text("job"),
            world_size=None
            if world is None
            else bounded_int(world, lo=0, hi=MAX_WORLD, what="world_size", source=source),
            detected_at=text("detected_at"),
            culprit=None
            if culprit is None
            else bounded_int(culprit, lo=0, hi=MAX_WORLD - 1, what="culprit", source=source),
            summary=text("summary"),
        )


@dataclass(frozen=True)
class IncidentDir:
    """One node's directory of an incident: its verdict, its dumps, what could not be read."""

    path: Path
    verdict: Verdict | None
    dumps: tuple[DumpFile, ...]
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Incident:
    """An incident: the directories, one per node, that share its id."""

    incident_id: str
    dirs: tuple[IncidentDir, ...]
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


def _name_time(name: str) -> datetime | None:
    try:
        return datetime.strptime(name[:15], "%Y%m%d-%H%M%S").replace(tzinfo=UTC)
    except ValueError:
        return None


def _when(d: IncidentDir) -> datetime:
    if d.verdict is not None:
        t = _parse_time(d.verdict.detected_at)
        if t is not None:
            return t
    t = _name_time(d.path.name)
    if t is not None:
        return t
    mtimes = []
    for f in d.dumps:
        try:
            mtimes.append(os.stat(os.path.join(f.directory, f.name)).st_mtime)
        except OSError:
            continue
    return datetime.fromtimestamp(max(mtimes), tz=UTC) if mtimes else _EPOCH


def read_dir(path: Path) -> IncidentDir:
    verdict = None
    problems: list[str] = []
    vpath = path / VERDICT_FILE
    if os.path.lexists(vpath):
        try:
            raw = read_json(vpath, max_bytes=VERDICT_MAX_BYTES)
            verdict = Verdict.from_dict(raw, str(vpath))
        except UntrustedInput as e:
            problems.append(
                f"{clean(e.path)}: unreadable verdict ({clean(e.problem)}); "
                "directory taken on its own"
            )
            log.warning("%s", problems[-1])
    found = scan(path)
    problems.extend(found.problems(path))
    return IncidentDir(path=path, verdict=verdict, dumps=found.files, problems=tuple(problems))


def _is_verdict(path: Path) -> bool:
    return (path / VERDICT_FILE).is_file() and not (path / VERDICT_FILE).is_symlink()


def is_incident_dir(path: Path) -> bool:
    return _is_verdict(path) or has_dumps(path)


def _group(dirs: list[IncidentDir]) -> list[Incident]:
    by_id: dict[str, list[IncidentDir]] = {}
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
    if _is_verdict(path):
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
