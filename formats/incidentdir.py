"""Incident directories: one per node per incident under the timeline path.

    <timeline>/<YYYYmmdd-HHMMSS>-<kind>-<node>@<incident id>/
        verdict.json                      what was decided and why (format diag.verdict/1)
        {rank:05d}-{world:05d}.stack.json one stack dump per local rank (formats/stackdump.py)
        {rank:05d}-{world:05d}.journal.json the rank's journal tail
        machine.json                      node and process snapshot

The directory is built under a hidden temporary name and renamed into place when complete, so a
viewer never reads half an incident. Directories of one incident on several nodes share the
`incident_id` in their verdict.json, and its key ends their names: one listing of the timeline
finds every node's directory of an incident, none of them read.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.formats.untrusted import MIB, read_json, write_file_nofollow

VERDICT_MAX_BYTES = 4 * MIB
VERDICT_FORMAT = "diag.verdict/1"
VERDICT_FILE = "verdict.json"


def incident_id_of(job: str, verdict_id: str) -> str:
    """The id an incident carries in its verdict.json: the job's name, then the verdict's id
    (which names the stuck collective, so the nodes of one incident share it)."""
    return f"{job}-{verdict_id}" if job else verdict_id


def incident_key(incident_id: str) -> str:
    """An incident id as it ends directory names: the same on every node."""
    return re.sub(r"[^A-Za-z0-9_.~-]+", "_", incident_id)[:120] or "incident"


def dir_name(when: dt.datetime, kind: str, node: str, incident_id: str = "") -> str:
    safe_node = re.sub(r"[^A-Za-z0-9_.-]+", "_", node)[:63] or "node"
    name = f"{when.strftime('%Y%m%d-%H%M%S')}-{kind.replace('_', '-')}-{safe_node}"
    return f"{name}@{incident_key(incident_id)}" if incident_id else name


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
    doc = read_json(path, max_bytes=VERDICT_MAX_BYTES)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a verdict (a JSON object expected)")
    doc.setdefault("own_incident_id", doc.get("incident_id"))
    doc["incident_id"] = incident_id
    doc["summary"] = f"{doc.get('summary', '')} ({note})"
    write_file_nofollow(path, json.dumps(doc, indent=1).encode())


@dataclass
class IncidentDir:
    final: Path
    tmp: Path

    @classmethod
    def create(
        cls, timeline: Path, kind: str, node: str, when: dt.datetime, incident_id: str = ""
    ) -> IncidentDir:
        timeline.mkdir(parents=True, exist_ok=True)
        base = dir_name(when, kind, node, incident_id)
        final = timeline / base
        n = 1
        while final.exists():
            n += 1
            final = timeline / f"{base}.{n}"
        tmp = timeline / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        return cls(final=final, tmp=tmp)

    def write_json(self, name: str, doc: Any) -> Path:
        return self.write_text(name, json.dumps(doc, indent=1, default=_jsonable))

    def write_text(self, name: str, text: str) -> Path:
        path = self.tmp / name
        write_file_nofollow(path, text.encode())  # never through a planted symlink
        return path

    def commit(self) -> Path:
        os.replace(self.tmp, self.final)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


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
