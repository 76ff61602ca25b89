"""torch's flight recorder dumps in an incident: read, checked, and what they say.

The agent writes them under `flight-recorder/` of the incident directory, one file per rank and
recorder: `{rank:05d}-{world:05d}.json` (gloo and the CPU backends) and
`{rank:05d}-{world:05d}.nccl.json` (NCCL), torch's own JSON (`fr_trace_json`,
`dump_nccl_trace_json`), plus `errors.json` for ranks that gave none. Like the journal tails,
they sit beside the stacks: per rank, the last collectives with their process group, sequence
number and state; per group, which ranks are behind the others on its sequence numbers (a rank
that never enqueued the collective its peers wait in is the one holding them).

Every file is input from another process: a regular file under the size cap, not followed
through a symlink, validated into the types below; a bad one is reported for its rank, like a
corrupt stack dump, and the merge goes on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from diag.formats.untrusted import (
    UntrustedInput,
    bounded_int,
    open_dir,
    parse_json,
    printable,
    read_bounded,
)

FR_DIR = "flight-recorder"
ERRORS_FILE = "errors.json"
MAX_FILE_BYTES = 64 << 20
MAX_ERRORS_BYTES = 1 << 20
MAX_ENTRIES = 100_000
MAX_RANK = 1 << 24
MAX_TEXT = 200
LAST_SHOWN = 3  # entries per rank in summary.txt
_NAME = re.compile(r"^(\d{5,8})-(\d{5,8})(\.nccl)?\.json$")
_SEQ_MAX = (1 << 63) - 1
STATES = ("scheduled", "started", "completed")


@dataclass(frozen=True)
class FlightEntry:
    """One collective or p2p op in a rank's ring."""

    record_id: int
    pg_id: int
    group: str  # the process group's name (the same on every member)
    group_desc: str
    seq: int  # collective_seq_id, or p2p_seq_id for p2p ops
    is_p2p: bool
    op: str  # torch's profiling name, e.g. nccl:all_reduce
    state: str  # scheduled, started or completed (completion told by the group's status too)
    time_created_ns: int


@dataclass(frozen=True)
class GroupStatus:
    pg_id: int
    last_enqueued: int
    last_started: int
    last_completed: int


@dataclass(frozen=True)
class FlightRecord:
    """One rank's dump of one recorder."""

    rank: int
    world_size: int
    backend: str  # "nccl" or "cpu"
    file: str
    version: str
    entries: tuple[FlightEntry, ...]  # oldest first
    status: tuple[GroupStatus, ...]

    def last_enqueued(self, group: str) -> int:
        """The highest collective sequence number of `group` this rank enqueued, -1: none."""
        seqs = [e.seq for e in self.entries if e.group == group and not e.is_p2p]
        ids = {e.pg_id for e in self.entries if e.group == group}
        seqs += [s.last_enqueued for s in self.status if s.pg_id in ids]
        return max(seqs, default=-1)


@dataclass(frozen=True)
class Lag:
    """Ranks behind the others on a group's collective sequence numbers."""

    backend: str
    group: str
    group_desc: str
    ahead: int  # the highest sequence number any rank enqueued
    behind: tuple[tuple[int, int], ...]  # (rank, its last enqueued sequence number)


@dataclass(frozen=True)
class FlightReport:
    records: tuple[FlightRecord, ...]
    errors: tuple[tuple[int, str], ...]  # rank (-1: not a rank's file) -> why it has none
    lags: tuple[Lag, ...]

    @property
    def empty(self) -> bool:
        return not self.records and not self.errors


def _text(value: object, what: str, source: str) -> str:
    if not isinstance(value, str):
        raise UntrustedInput(source, f"{what} must be a string, got {type(value).__name__}")
    return printable(value, keep_newlines=False)[:MAX_TEXT]


def _seq(value: object, what: str, source: str) -> int:
    # torch writes pg_status numbers as strings ("-1" before the first)
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
        value = int(value)
    return bounded_int(value, lo=-1, hi=_SEQ_MAX, what=what, source=source)


def _status(raw: object, source: str) -> tuple[GroupStatus, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise UntrustedInput(source, "pg_status must be an object")
    out = []
    for key, st in list(raw.items())[:MAX_ENTRIES]:
        if not isinstance(st, dict):
            raise UntrustedInput(source, f"pg_status[{key!r}] must be an object")
        out.append(
            GroupStatus(
                pg_id=_seq(key, "pg_status key", source),
                last_enqueued=_seq(st.get("last_enqueued_collective", -1), "enqueued", source),
                last_started=_seq(st.get("last_started_collective", -1), "started", source),
                last_completed=_seq(st.get("last_completed_collective", -1), "completed", source),
            )
        )
    return tuple(out)


def _entry(raw: object, status: dict[int, GroupStatus], source: str) -> FlightEntry:
    if not isinstance(raw, dict):
        raise UntrustedInput(source, "an entry must be an object")
    pg = raw.get("process_group")
    if not (isinstance(pg, list) and len(pg) == 2):
        raise UntrustedInput(source, "process_group must be [name, description]")
    is_p2p = raw.get("is_p2p", False)
    if not isinstance(is_p2p, bool):
        raise UntrustedInput(source, "is_p2p must be true or false")
    key = "p2p_seq_id" if is_p2p else "collective_seq_id"
    seq = _seq(raw.get(key, -1), key, source)
    pg_id = _seq(raw.get("pg_id", -1), "pg_id", source)
    state = _text(raw.get("state", ""), "state", source)
    if state not in STATES:
        raise UntrustedInput(source, f"state {state!r} is not one of {', '.join(STATES)}")
    st = status.get(pg_id)
    retired = raw.get("retired", False) is True
    # gloo leaves finished entries "scheduled"; the group's status (and retirement) tells
    if (not is_p2p and st is not None and st.last_completed >= seq >= 0) or retired:
        state = "completed"
    elif not is_p2p and st is not None and st.last_started >= seq >= 0 and state == "scheduled":
        state = "started"
    return FlightEntry(
        record_id=_seq(raw.get("record_id", -1), "record_id", source),
        pg_id=pg_id,
        group=_text(pg[0], "process group name", source),
        group_desc=_text(pg[1], "process group description", source),
        seq=seq,
        is_p2p=is_p2p,
        op=_text(raw.get("profiling_name", ""), "profiling_name", source),
        state=state,
        time_created_ns=_seq(raw.get("time_created_ns", 0), "time_created_ns", source),
    )


def parse_dump(
    data: bytes, source: str, *, rank: int, world_size: int, backend: str
) -> FlightRecord:
    """A flight recorder dump (torch's JSON) into a FlightRecord; UntrustedInput when it is not
    one."""
    if len(data) > MAX_FILE_BYTES:
        raise UntrustedInput(source, f"is over the {MAX_FILE_BYTES}-byte limit")
    doc = parse_json(source, data)
    if not isinstance(doc, dict):
        raise UntrustedInput(source, "is not a flight recorder dump (not a JSON object)")
    entries = doc.get("entries", [])
    if not isinstance(entries, list):
        raise UntrustedInput(source, "entries must be a list")
    if len(entries) > MAX_ENTRIES:
        raise UntrustedInput(source, f"has {len(entries)} entries, over {MAX_ENTRIES}")
    status = _status(doc.get("pg_status"), source)
    by_id = {s.pg_id: s for s in status}
    parsed = tuple(_entry(e, by_id, source) for e in entries)
    version = doc.get("version", "")
    return FlightRecord(
        rank=rank,
        world_size=world_size,
        backend=backend,
        file=source,
        version=_text(version, "version", source) if version != "" else "",
        entries=tuple(sorted(parsed, key=lambda e: (e.time_created_ns, e.record_id))),
        status=status,
    )


def file_identity(name: str, world_limit: int = MAX_RANK) -> tuple[int, int, str] | None:
    """(rank, world size, backend) from a dump's name; None when the name is not a dump's."""
    m = _NAME.match(name)
    if m is None:
        return None
    rank, world = int(m.group(1)), int(m.group(2))
    if not 0 <= rank < world <= world_limit:
        return None
    return rank, world, "nccl" if m.group(3) else "cpu"


def read_dir(incident: Path, world_limit: int = MAX_RANK) -> tuple[list[FlightRecord], list]:
    """The dumps under `incident/flight-recorder/` and the problems, per rank. No directory:
    nothing (an incident from before the flight recorder was taken)."""
    records: list[FlightRecord] = []
    errors: list[tuple[int, str]] = []
    try:
        base = open_dir(incident)
    except UntrustedInput as e:
        return records, [(-1, str(e))]
    try:
        try:
            d = open_dir(FR_DIR, dir_fd=base)
        except UntrustedInput as e:
            if not os.path.lexists(incident / FR_DIR):
                return records, errors
            return records, [(-1, str(e))]
        try:
            for name in sorted(os.listdir(d)):
                shown = str(incident / FR_DIR / name)
                if name == ERRORS_FILE:
                    errors.extend(_agent_errors(d, shown, world_limit))
                    continue
                ident = file_identity(name, world_limit)
                if ident is None:
                    continue
                rank, world, backend = ident
                try:
                    data = read_bounded(name, max_bytes=MAX_FILE_BYTES, dir_fd=d)
                    records.append(
                        parse_dump(data, shown, rank=rank, world_size=world, backend=backend)
                    )
                except UntrustedInput as e:
                    errors.append((rank, str(e)))
        finally:
            os.close(d)
    finally:
        os.close(base)
    return records, errors


def _agent_errors(d: int, shown: str, world_limit: int) -> list[tuple[int, str]]:
    try:
        doc = parse_json(shown, read_bounded(ERRORS_FILE, max_bytes=MAX_ERRORS_BYTES, dir_fd=d))
    except UntrustedInput as e:
        return [(-1, str(e))]
    if not isinstance(doc, dict):
        return [(-1, f"{shown}: not a JSON object")]
    out = []
    for key, why in doc.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < world_limit):
            continue
        lines = why if isinstance(why, list) else [why]
        text = "; ".join(printable(str(x), keep_newlines=False)[:MAX_TEXT] for x in lines[:8])
        out.append((int(key), f"no flight recorder: {text}"))
    return out


def lags(records: list[FlightRecord]) -> tuple[Lag, ...]:
    """Per (recorder, group): the ranks whose last enqueued collective is behind the highest any
    member enqueued. Only ranks with a dump are compared."""
    groups: dict[tuple[str, str], str] = {}
    for r in records:
        for e in r.entries:
            if not e.is_p2p:
                groups.setdefault((r.backend, e.group), e.group_desc)
    out = []
    for (backend, group), desc in sorted(groups.items()):
        last = {r.rank: r.last_enqueued(group) for r in records if r.backend == backend}
        last = {k: v for k, v in last.items() if v >= 0 or _member(records, k, backend, group)}
        if len(last) < 2:
            continue
        ahead = max(last.values())
        behind = tuple(sorted((k, v) for k, v in last.items() if v < ahead))
        if behind:
            out.append(Lag(backend, group, desc, ahead, behind))
    return tuple(out)


def _member(records: list[FlightRecord], rank: int, backend: str, group: str) -> bool:
    return any(
        e.group == group for r in records if r.rank == rank and r.backend == backend
        for e in r.entries
    )  # fmt: skip


def read_incident(dirs: list[Path], world_limit: int = MAX_RANK) -> FlightReport:
    records: list[FlightRecord] = []
    errors: list[tuple[int, str]] = []
    for d in dirs:
        got, errs = read_dir(d, world_limit)
        records.extend(got)
        errors.extend(errs)
    records.sort(key=lambda r: (r.rank, r.backend))
    return FlightReport(tuple(records), tuple(sorted(errors)), lags(records))
