"""Fuzz targets of what the agent reads back from the shared timeline for itself: the job's
taint ledger (a node's claim, the taint history) and the verdict.json by which retention tells
this node's incident directories from the rest. Each is read through the path the agent reads
it by; a claim is refused with UntrustedInput, the history and the budget never refuse (a bad
line is dropped, a bad claim counts as held), so only a crash or a hang is a finding there."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fuzzkit import FuzzTarget

from diag.agent.taint.ledger import HISTORY, LEDGER_DIR, Claim, TaintLedger, read_claim
from diag.agent.taint.model import Action, Reason, TaintPlan, TaintRecord
from diag.formats.incidentdir import VERDICT_FILE, VERDICT_FORMAT, verdict_in

JOB = "job"
NOW = 1_800_000_000.0
CLAIM_AT = f"{LEDGER_DIR}/{JOB}/node-1.json"
HISTORY_AT = f"{LEDGER_DIR}/{JOB}/{HISTORY}"
INCIDENT = "20261125-000000-hang-node-1@job-a0-hang"


def _claim_seeds(scratch: Path) -> list[bytes]:
    (scratch / CLAIM_AT).parent.mkdir(parents=True, exist_ok=True)
    return [
        Claim("node-1", NOW, NOW + 86400, "RepeatedCulprit", "job-a0-hang").to_bytes(),
        Claim("node-1", NOW, None).to_bytes(),
    ]


def _parse_claim(path: Path) -> object:
    d = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        claim = read_claim(d, path.name, path)
    finally:
        os.close(d)
    return claim.held(NOW)


def _history_seeds(scratch: Path) -> list[bytes]:
    (scratch / HISTORY_AT).parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"node": "node-1", "at": NOW}).encode()
    lines = [json.dumps({"node": f"node-{i}", "at": NOW - i * 60.0}) for i in range(5)]
    return [line, ("\n".join(lines) + "\n").encode()]


def _parse_history(path: Path) -> object:
    """The budget (what the planner reads), then a taint recorded: the history read, trimmed
    and written back whole, as an agent does under the job's lock."""
    ledger = TaintLedger(path.parents[2], JOB, timeout=1.0)
    budget = ledger.budget(NOW)
    record = TaintRecord(Reason.GPU_ECC, "ecc", since=NOW, until=None)
    with ledger.locked():
        ledger.record(TaintPlan("node-2", Action.TAINT, "fuzz", record=record), NOW)
    return budget


def _verdict_seeds(scratch: Path) -> list[bytes]:
    (scratch / INCIDENT).mkdir(exist_ok=True)
    doc = {
        "format": VERDICT_FORMAT,
        "incident_id": "job-a0-hang",
        "kind": "hang",
        "job": "job",
        "node": "node-1",
        "world_size": 8,
        "detected_at": "2026-11-25T00:00:00.000+00:00",
        "culprit": 3,
        "suspects": [{"rank": 3, "kind": "late", "reason": "r", "score": 1.0}],
        "summary": "rank 3 never joined all_reduce",
    }
    return [json.dumps(doc, indent=1).encode(), json.dumps({**doc, "culprit": None}).encode()]


def _parse_verdict(path: Path) -> object:
    d = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return verdict_in(d, path.parent).node
    finally:
        os.close(d)


TARGETS = [
    FuzzTarget("taint_ledger_claim", _claim_seeds, _parse_claim, file_name=CLAIM_AT, json=True),
    FuzzTarget(
        "taint_ledger_history", _history_seeds, _parse_history, file_name=HISTORY_AT, json=True
    ),
    FuzzTarget(
        "retention_incident_verdict",
        _verdict_seeds,
        _parse_verdict,
        file_name=f"{INCIDENT}/{VERDICT_FILE}",
        json=True,
    ),
]
