"""Fuzz targets: the files other nodes' agents and other processes leave for the job verdict,
the precheck and the reclaim notice, each read through the path diag reads it by."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

from fuzzkit import FuzzTarget
from prometheus_client import generate_latest
from reportshapes import JOB, as_json_doc, node_report, precheck_report

from diag.agent.drain.notice import NoticeFormatError, parse_aws, parse_gce, parse_token, read_body
from diag.agent.job.decisions import Claim, Where, parse_name
from diag.agent.job.files import read_report
from diag.agent.job.nodeview import analyse
from diag.agent.job.verdict import JobVerdictStore
from diag.agent.precheck.promfile import read_textfile, registry_for
from diag.agent.precheck.report import read_report as read_precheck_report
from diag.agent.precheck.table import render
from diag.agent.taint.evidencesources import from_precheck_report
from diag.formats.exitcodes import UsageError
from diag.formats.untrusted import UntrustedInput

INCIDENT = "a0-hang-pg0-seq42"
REPORT_NAME = "r7.L.node-0~20261125-000000-hang-node-0@job-a0-hang"
VERDICT_AT = f".jobs/{JOB}/{INCIDENT}/job-verdict.json"
CLAIM_AT = f".jobs/{JOB}/{INCIDENT}/claim"


def _report_seeds(scratch: Path) -> list[bytes]:
    first = node_report(scratch, 0, 3, culprit=7)
    assert first.where == Where.LOCAL
    bare = as_json_doc(first)
    bare["view"] = None
    return [json.dumps(as_json_doc(first)).encode(), json.dumps(bare).encode()]


def _parse_report(path: Path) -> object:
    name = parse_name(path.name)
    assert name is not None
    d = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        r, _ = read_report(d, name, path, path.parent)
    finally:
        os.close(d)
    # What the claimant does next with an accepted report must not fail either.
    return analyse([r.view] if r.view is not None else [], time.time())


def _verdict_seeds(scratch: Path) -> list[bytes]:
    store = JobVerdictStore(scratch / ".jobs", settle=60.0)
    for node in range(3):
        store.file(JOB, INCIDENT, node_report(scratch, node, 3, culprit=7 if node == 0 else None))
    v = store.conclude(JOB, INCIDENT, first_seen=0.0, now_wall=time.time(), force=True)
    assert v is not None and v.culprit == 7
    seed = (scratch / VERDICT_AT).read_bytes()
    (scratch / VERDICT_AT).unlink()
    return [seed]


def _parse_verdict(path: Path) -> object:
    root = path.parents[2]
    return JobVerdictStore(root).load(JOB, INCIDENT)


def _claim_seeds(scratch: Path) -> list[bytes]:
    (scratch / CLAIM_AT).parent.mkdir(parents=True, exist_ok=True)
    return [
        Claim("node-0", Where.LOCAL, 7, time.time()).text().encode(),
        Claim("node-3", Where.REMOTE, None, time.time()).text().encode(),
    ]


def _parse_claim(path: Path) -> object:
    store = JobVerdictStore(path.parents[2])
    return store.known(JOB, 0, since_wall=0.0), store.claimed_first_hand(JOB, INCIDENT)


def _precheck_seeds(scratch: Path) -> list[bytes]:
    return [json.dumps(precheck_report().to_dict(), indent=2).encode()]


def _parse_precheck(path: Path) -> object:
    report = read_precheck_report(path)
    # What the agent and `diag precheck` do next with an accepted report: the metrics, the
    # table, the taint evidence.
    generate_latest(registry_for(report))
    render(report)
    return from_precheck_report(path, "host-1")


def _metrics_seeds(scratch: Path) -> list[bytes]:
    return [generate_latest(registry_for(precheck_report()))]


def _notice_seeds(scratch: Path) -> list[bytes]:
    return [
        b'{"action": "terminate", "time": "2026-11-25T10:00:00Z"}',
        b'{"action": "stop", "time": "2026-11-25T10:00:00.123Z"}',
        b"TRUE",
        b"AQAEAHmQ6Kb1kJ7X-token_value==",
    ]


def _parse_notice(path: Path) -> object:
    """The body as the watcher reads it (bounded), through each parser of metadata answers."""
    with path.open("rb") as f:
        body = read_body(io.BufferedReader(f))  # type: ignore[arg-type]
    out = []
    for parse in (lambda b: parse_aws(200, b), lambda b: parse_gce(200, b), parse_token):
        try:
            out.append(parse(body))
        except NoticeFormatError:
            out.append(None)
    return out


TARGETS = [
    FuzzTarget("job_node_report", _report_seeds, _parse_report, file_name=REPORT_NAME, json=True),
    FuzzTarget("job_verdict", _verdict_seeds, _parse_verdict, file_name=VERDICT_AT, json=True),
    FuzzTarget("job_claim", _claim_seeds, _parse_claim, file_name=CLAIM_AT),
    FuzzTarget(
        "precheck_report",
        _precheck_seeds,
        _parse_precheck,
        refusals=(UntrustedInput, UsageError),
        file_name="precheck.json",
        json=True,
    ),
    FuzzTarget("precheck_metrics", _metrics_seeds, read_textfile, file_name="precheck.prom"),
    FuzzTarget(
        "notice_body", _notice_seeds, _parse_notice, refusals=(NoticeFormatError,), json=True
    ),
]
