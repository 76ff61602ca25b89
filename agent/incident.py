"""Incident directories: one per node per incident under the timeline path.

    <timeline>/<YYYYmmdd-HHMMSS>-<kind>-<node>/
        verdict.json                      what was decided and why (format diag.verdict/1)
        {rank:05d}-{world:05d}.stack.json one stack dump per local rank (viewer/stacks.py)
        {rank:05d}-{world:05d}.journal.json the rank's journal tail
        machine.json                      node and process snapshot

The directory is built under a hidden temporary name and renamed into place when complete, so a
viewer never reads half an incident. Directories of one incident on several nodes share the
`incident_id` in their verdict.json.
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

VERDICT_FORMAT = "diag.verdict/1"
VERDICT_FILE = "verdict.json"


def incident_id_of(job: str, verdict_id: str) -> str:
    """The id an incident carries in its verdict.json: the job's name, then the verdict's id
    (which names the stuck collective, so the nodes of one incident share it)."""
    return f"{job}-{verdict_id}" if job else verdict_id


def dir_name(when: dt.datetime, kind: str, node: str) -> str:
    safe_node = re.sub(r"[^A-Za-z0-9_.-]+", "_", node)[:63] or "node"
    return f"{when.strftime('%Y%m%d-%H%M%S')}-{kind.replace('_', '-')}-{safe_node}"


@dataclass
class IncidentDir:
    final: Path
    tmp: Path

    @classmethod
    def create(cls, timeline: Path, kind: str, node: str, when: dt.datetime) -> IncidentDir:
        timeline.mkdir(parents=True, exist_ok=True)
        base = dir_name(when, kind, node)
        final = timeline / base
        n = 1
        while final.exists():
            n += 1
            final = timeline / f"{base}.{n}"
        tmp = timeline / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        return cls(final=final, tmp=tmp)

    def write_json(self, name: str, doc: Any) -> Path:
        path = self.tmp / name
        path.write_text(json.dumps(doc, indent=1, default=_jsonable))
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.write_text(text)
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
