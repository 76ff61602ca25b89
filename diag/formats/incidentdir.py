"""Incident directories: one per node per incident under the timeline path.

    <timeline>/<YYYYmmdd-HHMMSS>-<kind>-<node>@<incident id>/
        verdict.json                      what was decided and why (format diag.verdict/1)
        {rank:05d}-{world:05d}.stack.json one stack dump per local rank (diag/formats/stackdump.py)
        {rank:05d}-{world:05d}.journal.json the rank's journal tail
        machine.json                      node and process snapshot

The directory is built under a hidden temporary name and renamed into place when complete, so a
viewer never reads half an incident. Directories of one incident on several nodes share the
`incident_id` in their verdict.json, and its key ends their names: one listing of the timeline
finds every node's directory of an incident, none of them read.

`IncidentDir` is one such directory for both of its sides: the agent builds one
(`IncidentDir.create`, `write_json`, `commit`), the viewer reads one (`read_verdict`, and its own
scan of the dump files, which also accepts other tools' formats). `probe_timeline` is the
agent's start-up check that it can write incidents at all; `node_dir_pattern` and
`verdict_in` tell retention which directories this node wrote.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from diag.formats.inputcaps import MAX_WORLD, clean
from diag.formats.inputcaps import VERDICT_MAX_BYTES as READ_VERDICT_MAX_BYTES
from diag.formats.untrusted import (
    MIB,
    UntrustedInput,
    bounded_int,
    create_new,
    read_json,
    write_file_nofollow,
)

# A verdict this node's agent wrote (`retag` rewrites one, retention reads one); any verdict read
# (the viewer's, from any timeline) is capped at inputcaps.VERDICT_MAX_BYTES.
RETAG_VERDICT_MAX_BYTES = 4 * MIB
VERDICT_FORMAT = "diag.verdict/1"
VERDICT_FILE = "verdict.json"
MACHINE_FILE = "machine.json"
JOURNAL_TAIL_SUFFIX = ".journal.json"
_NAME_TIME_FORMAT = "%Y%m%d-%H%M%S"

D = TypeVar("D")  # how the reader represents a dump file (the viewer's DumpFile)


def incident_id_of(job: str, verdict_id: str) -> str:
    """The id an incident carries in its verdict.json: the job's name, then the verdict's id
    (which names the stuck collective, so the nodes of one incident share it)."""
    return f"{job}-{verdict_id}" if job else verdict_id


def incident_key(incident_id: str) -> str:
    """An incident id as it ends directory names: the same on every node."""
    return re.sub(r"[^A-Za-z0-9_.~-]+", "_", incident_id)[:120] or "incident"


def _safe_node(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", node)[:63] or "node"


def dir_name(when: dt.datetime, kind: str, node: str, incident_id: str = "") -> str:
    name = f"{when.strftime(_NAME_TIME_FORMAT)}-{kind.replace('_', '-')}-{_safe_node(node)}"
    return f"{name}@{incident_key(incident_id)}" if incident_id else name


def node_dir_pattern(node: str) -> re.Pattern[str]:
    """The names `dir_name` (and `create`'s `.n`) gives `node`'s incident directories, whatever
    their time, kind and incident. A node whose name ends another's (`b-n1`, `n1`) matches too:
    the verdict inside says which node wrote it (`verdict_in`)."""
    return re.compile(
        rf"^\d{{8}}-\d{{6}}-[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*-{re.escape(_safe_node(node))}"
        r"(?:@[A-Za-z0-9_.~-]+)?(?:\.\d+)?$"
    )


def name_time(name: str) -> dt.datetime | None:
    """The time a directory's name begins with (UTC), None when it begins with none."""
    try:
        return dt.datetime.strptime(name[:15], _NAME_TIME_FORMAT).replace(tzinfo=dt.UTC)
    except ValueError:
        return None


def journal_tail_file(rank: int, world_size: int) -> str:
    return f"{rank:05d}-{world_size:05d}{JOURNAL_TAIL_SUFFIX}"


def tail_name(dump_name: str) -> str:
    """The journal tail beside a dump file: `00003-00008.stack.json` ->
    `00003-00008.journal.json`."""
    return dump_name.split(".", 1)[0] + JOURNAL_TAIL_SUFFIX


def find_dirs(timeline: Path, key: str) -> list[Path]:
    """The incident directories of every node whose names end with `key` (one listing)."""
    ending = re.compile(rf"@{re.escape(key)}(\.\d+)?$")
    try:
        names = os.listdir(timeline)
    except FileNotFoundError:
        return []
    return sorted(timeline / n for n in names if not n.startswith(".") and ending.search(n))


def retag(incident: Path, incident_id: str, note: str) -> None:
    """Moves a finished incident directory into another incident (its verdict's id, which
    `diag merge` groups by), keeping the id it had and saying why."""
    path = incident / VERDICT_FILE
    doc = read_json(path, max_bytes=RETAG_VERDICT_MAX_BYTES)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a verdict (a JSON object expected)")
    doc.setdefault("own_incident_id", doc.get("incident_id"))
    doc["incident_id"] = incident_id
    doc["summary"] = f"{doc.get('summary', '')} ({note})"
    write_file_nofollow(path, json.dumps(doc, indent=1).encode())


@dataclass(frozen=True)
class Verdict:
    """The fields of `verdict.json` its readers use; unknown fields are ignored."""

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


def has_verdict(path: Path) -> bool:
    """Whether `path` holds a verdict.json (a regular file, not a symlink)."""
    return (path / VERDICT_FILE).is_file() and not (path / VERDICT_FILE).is_symlink()


def read_verdict(path: Path) -> tuple[Verdict | None, tuple[str, ...]]:
    """The verdict of the incident directory `path` (None without one), and why one there could
    not be read: the directory is then taken on its own."""
    vpath = path / VERDICT_FILE
    if not os.path.lexists(vpath):
        return None, ()
    try:
        raw = read_json(vpath, max_bytes=READ_VERDICT_MAX_BYTES)
        return Verdict.from_dict(raw, str(vpath)), ()
    except UntrustedInput as e:
        problem = (
            f"{clean(e.path)}: unreadable verdict ({clean(e.problem)}); directory taken on its own"
        )
        return None, (problem,)


def verdict_in(dir_fd: int, where: Path) -> Verdict:
    """The verdict of the incident directory open as `dir_fd` (at `where`, for messages), read
    capped, without following a symlink or blocking on a FIFO; UntrustedInput if there is none
    to believe."""
    source = str(where / VERDICT_FILE)
    try:
        raw = read_json(VERDICT_FILE, max_bytes=RETAG_VERDICT_MAX_BYTES, dir_fd=dir_fd)
    except UntrustedInput as e:
        raise UntrustedInput(source, e.problem) from None
    return Verdict.from_dict(raw, source)


def probe_timeline(timeline: Path) -> None:
    """Shows that incidents can be written to `timeline` (made if missing), or raises OSError.

    Anyone who writes the timeline (trainers, other nodes) could have planted the probe's name
    as a link to a file of ours, so the probe creates a new file of a random name
    (`O_EXCL|O_NOFOLLOW`) and removes it by the directory's descriptor: it never opens,
    truncates or removes anything it did not just make. The root itself may be a symlink: it is
    the operator's path (volumes are mounted where they please), not something a writer of the
    timeline can plant; below it nothing is followed."""
    timeline.mkdir(parents=True, exist_ok=True)
    d = os.open(timeline, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        name = f".diag-write-test-{secrets.token_hex(8)}"
        os.close(create_new(name, dir_fd=d, mode=0o600))
        os.unlink(name, dir_fd=d)
    finally:
        os.close(d)


@dataclass(frozen=True)
class IncidentDir(Generic[D]):
    """One node's directory of an incident. Read: its verdict, its dumps, what could not be read.
    Being built (`create`): `tmp`, the hidden directory its files are written to until `commit`
    renames it to `path`."""

    path: Path
    verdict: Verdict | None = None
    dumps: tuple[D, ...] = ()
    problems: tuple[str, ...] = ()
    tmp: Path | None = None

    @classmethod
    def create(
        cls, timeline: Path, kind: str, node: str, when: dt.datetime, incident_id: str = ""
    ) -> IncidentDir[Any]:
        timeline.mkdir(parents=True, exist_ok=True)
        base = dir_name(when, kind, node, incident_id)
        final = timeline / base
        n = 1
        while final.exists():
            n += 1
            final = timeline / f"{base}.{n}"
        tmp = timeline / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        return cls(path=final, tmp=tmp)

    @property
    def staging(self) -> Path:
        """The hidden directory files are written to until `commit`."""
        if self.tmp is None:
            raise ValueError(f"{self.path}: a finished incident directory is not written to")
        return self.tmp

    def write_json(self, name: str, doc: Any) -> Path:
        return self.write_text(name, json.dumps(doc, indent=1, default=_jsonable))

    def write_text(self, name: str, text: str) -> Path:
        path = self.staging / name
        write_file_nofollow(path, text.encode())  # never through a planted symlink
        return path

    def commit(self) -> Path:
        os.replace(self.staging, self.path)
        return self.path

    def abandon(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "value"):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def utc_iso(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).isoformat(timespec="milliseconds")
