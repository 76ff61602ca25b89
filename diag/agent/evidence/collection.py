"""Evidence of an incident, captured once, before anything is killed: every local rank's stacks
(py-spy, in parallel), journal tails, a machine snapshot, and the verdict, as an incident directory.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diag.agent.detect.hang import Verdict
from diag.agent.evidence.frcapture import FR_DIR, FlightTarget, collect
from diag.agent.evidence.machine import machine_snapshot
from diag.agent.evidence.parallelism import (
    NATIVE_DUMP,
    PYTHON_DUMP,
    DumpCost,
    Parallelism,
    dump_parallelism,
    first_wave,
    learned_cost,
)
from diag.agent.evidence.pyspy import DumpTarget, Launcher, dump_all
from diag.agent.observe.cgroup import read_limits
from diag.agent.observe.containerlimits import ContainerLimits
from diag.formats.incidentdir import (
    MACHINE_FILE,
    VERDICT_FILE,
    VERDICT_FORMAT,
    IncidentDir,
    journal_tail_file,
    utc_iso,
)
from diag.formats.journal import JournalFormatError
from diag.formats.journalmeta import JournalMeta, read_meta, write_atomic
from diag.formats.journalreader import JournalReader
from diag.formats.stackdump import RankDump
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

FLIGHT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class EvidenceTarget:
    dump: DumpTarget
    journal: Path | None = None
    unproven: str = ""  # why its PID is not taken for the rank: no stack is taken then
    owners: Owners | None = None  # whose journal and meta are read

    @property
    def dumpable(self) -> bool:
        return not self.unproven and self.dump.pid > 0


@dataclass(frozen=True)
class EvidenceResult:
    path: Path
    dumps: tuple[RankDump, ...]
    started: float  # monotonic
    on_disk: float  # the incident directory exists with Python stacks of every rank
    finished: float  # native stacks added too

    @property
    def on_disk_seconds(self) -> float:
        return self.on_disk - self.started

    @property
    def total_seconds(self) -> float:
        return self.finished - self.started


@dataclass(frozen=True)
class IncidentReport:
    """An incident as the rest of the agent hears of it (job verdict, taints, metrics): the
    verdict and its evidence, None when none was captured."""

    verdict: Verdict
    evidence: EvidenceResult | None
    job: str
    node: str


def verdict_document(
    verdict: Verdict | None,
    *,
    kind: str,
    incident_id: str,
    job: str,
    node: str,
    world_size: int,
    detected_at: dt.datetime,
    summary: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": VERDICT_FORMAT,
        "incident_id": incident_id,
        "kind": kind,
        "job": job,
        "node": node,
        "world_size": world_size,
        "detected_at": utc_iso(detected_at),
        "culprit": None,
        "suspects": [],
        "summary": summary,
    }
    if verdict is not None:
        doc["culprit"] = verdict.culprit
        doc["suspects"] = [
            {"rank": s.rank, "kind": s.kind.value, "reason": s.reason, "score": s.score}
            for s in verdict.suspects
        ]
        doc["overdue"] = [
            {
                "rank": o.rank,
                "kind": o.kind.value,
                "age_s": round(o.age, 3),
                "limit_s": round(o.limit.seconds, 3),
                "limit_basis": o.limit.basis,
                "op": o.op.describe() if o.op else None,
                "idle_ranks": list(o.idle),  # the wait was judged on these idle ranks
            }
            for o in verdict.overdue
        ]
        doc["waits"] = [
            {
                "group": w.group,
                "group_seq": w.group_seq,
                "op": w.op.op.label,
                "nbytes": w.op.nbytes,
                "waiting_ranks": list(w.waiting),
                "waiting_s": round(verdict.at - w.since, 3),
            }
            for w in verdict.waits
        ]
        if verdict.expired_at is not None:
            doc["limit_expired_s_before_verdict"] = round(verdict.at - verdict.expired_at, 3)
    if extra:
        doc.update(extra)
    return doc


def journal_tail_document(
    path: Path, now: float, tail: int, owners: Owners | None = None
) -> dict[str, Any]:
    try:
        reader = JournalReader(path, owners=owners)
    except JournalFormatError as e:
        return {"journal": str(path), "error": str(e)}
    try:
        meta: JournalMeta | None = read_meta(path, owners)
    except (OSError, ValueError):
        meta = None
    try:
        groups = {g.index: g.name for g in meta.groups} if meta else {}
        state = reader.state()
        records = []
        for rec in reader.tail(tail):
            t = max(rec.t_enqueue_ns, rec.t_start_ns, rec.t_end_ns) * 1e-9
            records.append(
                {
                    "seq": rec.seq,
                    "kind": rec.kind.name.lower(),
                    "state": rec.state.name.lower(),
                    "op": rec.op.label if rec.kind.name == "OP" else None,
                    "group": groups.get(rec.group, rec.group) if rec.group >= 0 else None,
                    "group_seq": rec.group_seq,
                    "peer": rec.peer if rec.peer >= 0 else None,
                    "nbytes": rec.nbytes,
                    "dtype": rec.dtype.name.lower(),
                    "t_enqueue": rec.t_enqueue_ns * 1e-9 or None,
                    "t_start": rec.t_start_ns * 1e-9 or None,
                    "t_end": rec.t_end_ns * 1e-9 or None,
                    "age_s": round(now - t, 4) if t else None,
                    "step": rec.step,
                    "name": rec.name or None,
                    "tid": rec.tid or None,  # the issuing thread: the training thread
                }
            )
        return {
            "journal": str(path),
            "meta": asdict(meta) if meta else None,
            "status": state.status.name.lower(),
            "step": state.step,
            "phase": state.phase or None,
            "head": reader.head(),
            "monotonic_now": now,
            "records": records,
        }
    finally:
        reader.close()


def capture(
    targets: list[EvidenceTarget],
    timeline: Path,
    verdict_doc: dict[str, Any],
    *,
    native: bool = True,
    pyspy_timeout: float = 10.0,
    journal_tail: int = 256,
    dump_parallel: int = 0,
    limits: ContainerLimits | None = None,
    native_cost: DumpCost = NATIVE_DUMP,
    on_disk: Callable[[EvidenceResult], None] | None = None,
    launcher: Launcher | None = None,
) -> EvidenceResult:
    """Two passes: Python stacks of all ranks (~10 ms each) go to disk with the journals and the
    verdict at once; native stacks (slower: py-spy loads the libraries' symbols) then replace them
    rank by rank. A crash or a kill between the passes still leaves a complete incident.

    How many dumps run at once is bounded by the container's CPU quota (or `dump_parallel`) and
    by the memory its cgroup limits leave (`limits`, read now when not given): native dumps that
    would not fit are not started, so the agent is not OOM-killed in the middle of an incident.
    `native_cost` is what a native dump is assumed to take until the first ones have been
    measured (their peak resident size), which then decides how many run at once.
    `on_disk` is called between the passes, with the Python stacks, as soon as the incident
    directory is in place. `launcher` starts each py-spy (default: this process)."""
    started = time.monotonic()
    when = dt.datetime.now(dt.UTC)
    dump_targets = [t.dump for t in targets if t.dumpable]
    refused = [_not_dumped(t) for t in targets if not t.dumpable]
    incident = IncidentDir.create(
        timeline, verdict_doc["kind"], verdict_doc["node"], when, verdict_doc.get("incident_id", "")
    )
    doc = dict(verdict_doc)
    limits = limits if limits is not None else read_limits()
    python_width = dump_parallelism(
        len(targets), limits, PYTHON_DUMP, override=dump_parallel or len(targets)
    )
    try:
        dumps = dump_all(
            dump_targets, native=False, timeout=pyspy_timeout,
            parallel=max(1, python_width.count), launcher=launcher,
        ) if dump_targets else []  # fmt: skip
        dumps = _in_order(targets, [*dumps, *refused])
        python_done = time.monotonic()
        for t in targets:
            if t.journal is not None:
                name = journal_tail_file(t.dump.rank, t.dump.world_size)
                doc_ = journal_tail_document(t.journal, started, journal_tail, t.owners)
                incident.write_json(name, doc_)
        doc["flight_recorder"] = _flight_recorders(targets, incident.staging)
        snap = machine_snapshot({t.dump.rank: t.dump.pid for t in targets if t.dumpable}, timeline)
        incident.write_json(MACHINE_FILE, snap.to_dict())
        for d in dumps:
            incident.write_text(d.file_name, d.to_json())
        planned = dump_parallelism(
            len(dump_targets), limits, native_cost, override=dump_parallel
        ) if native and dump_targets else None  # fmt: skip
        width = first_wave(planned) if planned is not None else None
        doc["evidence"] = _evidence_doc(
            targets, dumps, python_done - started, native_pending=bool(width and width.count)
        )
        doc["evidence"]["on_disk_seconds"] = round(time.monotonic() - started, 3)
        if width is not None:
            doc["evidence"]["native_parallel"] = width.count
            doc["evidence"]["native_parallel_reason"] = width.reason
        incident.write_json(VERDICT_FILE, doc)
        path = incident.commit()
    except BaseException:
        incident.abandon()
        raise
    on_disk_at = time.monotonic()
    if on_disk is not None:
        on_disk(EvidenceResult(path, tuple(dumps), started, on_disk_at, on_disk_at))
    if width is not None and width.count == 0:
        log.warning("native stacks skipped, no room for py-spy (%s)", width.reason)
    elif width is not None:
        log.info("native stacks, %d at a time (%s)", width.count, width.reason)
        python = {d.rank: d for d in dumps}
        kept: dict[int, RankDump] = {}

        def replace_with_native(nat: RankDump) -> None:
            # Written as soon as taken: suspects come first in `targets`.
            py = python[nat.rank]
            if nat.error and not py.error:
                kept[nat.rank] = py  # keep the Python stack rather than an empty native one
                return
            write_atomic(path / nat.file_name, nat.to_json().encode())
            kept[nat.rank] = nat

        measured: list[tuple[int, Parallelism]] = []

        def widen(peak: int) -> int:
            # A py-spy measured: the width from its real size, within the limits read before.
            after = dump_parallelism(
                len(targets), limits, learned_cost(native_cost, peak), override=dump_parallel
            )
            measured.append((peak, after))
            return after.count

        natives = dump_all(
            dump_targets, native=True, timeout=pyspy_timeout, parallel=width.count,
            on_done=replace_with_native, widen=widen, launcher=launcher,
        )  # fmt: skip
        if measured:
            peak, after = measured[-1]
            log.info(
                "native stacks: py-spy peaked at %.0f MiB, then %d at a time (%s)",
                peak / (1 << 20), max(1, after.count), after.reason,
            )  # fmt: skip
        dumps = [kept.get(d.rank, d) for d in dumps]
        previous = doc["evidence"]
        doc["evidence"] = _evidence_doc(
            targets, dumps, time.monotonic() - started, native_pending=False,
            native_failures={n.rank: n.error for n in natives if n.error},
        )  # fmt: skip
        for key in ("on_disk_seconds", "native_parallel", "native_parallel_reason"):
            doc["evidence"][key] = previous[key]
        if measured:
            peak, after = measured[-1]
            doc["evidence"]["native_peak_mib"] = round(peak / (1 << 20), 1)
            doc["evidence"]["native_parallel_measured"] = max(1, after.count)
            doc["evidence"]["native_parallel_measured_reason"] = after.reason
        write_atomic(path / VERDICT_FILE, json.dumps(doc, indent=1).encode())
    return EvidenceResult(path, tuple(dumps), started, on_disk_at, time.monotonic())


def _flight_recorders(targets: list[EvidenceTarget], directory: Path) -> dict[str, Any]:
    """torch's flight recorder of every rank, under flight-recorder/ (see frcapture.py)."""
    fr = [
        FlightTarget(t.dump.rank, t.dump.world_size, t.dump.pid, t.journal)
        for t in targets
        if t.journal is not None and t.dumpable  # a rank not shown to be one is not asked
    ]
    try:
        dumps = collect(fr, directory, timeout=FLIGHT_TIMEOUT_S)
    except OSError as e:  # the recorder is extra evidence: never the reason an incident is lost
        log.warning("flight recorders not taken: %s", e)
        return {"dir": FR_DIR, "ranks": {}, "seconds": 0.0, "error": str(e)}
    return {
        "dir": FR_DIR,
        "ranks": {str(d.rank): {"files": list(d.files), "errors": list(d.errors)} for d in dumps},
        "seconds": max((d.seconds for d in dumps), default=0.0),
    }


def _not_dumped(t: EvidenceTarget) -> RankDump:
    return RankDump(
        rank=t.dump.rank,
        world_size=t.dump.world_size,
        pid=0,
        node=t.dump.node,
        local_rank=t.dump.local_rank,
        captured_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        error=f"no stack taken: {t.unproven or 'no process of this rank to dump'}",
    )


def _in_order(targets: list[EvidenceTarget], dumps: list[RankDump]) -> list[RankDump]:
    by_rank = {d.rank: d for d in dumps}
    return [by_rank[t.dump.rank] for t in targets]


def _evidence_doc(
    targets: list[EvidenceTarget],
    dumps: list[RankDump],
    seconds: float,
    *,
    native_pending: bool,
    native_failures: dict[int, str] | None = None,
) -> dict[str, Any]:
    return {
        "ranks": sorted(t.dump.rank for t in targets),
        "stack_failures": {d.rank: d.error for d in dumps if d.error},
        "native_failures": native_failures or {},
        "native": any(d.native for d in dumps),
        "native_pending": native_pending,
        "stack_seconds": round(seconds, 3),
    }
