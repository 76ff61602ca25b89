"""What other nodes' agents (or anything else that can write the shared timeline) leave for the
job verdict, the precheck's files and the metadata server's answers are outside data: a bad one
is left out with one warning naming it, never a traceback, a hang or a write elsewhere."""

from __future__ import annotations

import http.server
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from reportshapes import JOB, as_json_doc, node_report, precheck_report

from diag.agent.drain.notice import NoticeFormatError, NoticeSettings, NoticeWatcher, Provider
from diag.agent.job.files import MAX_REPORT_BYTES
from diag.agent.job.verdict import CLAIM_FILE, JOB_VERDICT_FILE, REPORTS_DIR, JobVerdictStore
from diag.agent.metrics.prechecktext import PrecheckFileCollector
from diag.agent.precheck.promfile import write_textfile
from diag.agent.taint.evidencesources import from_timeline

INCIDENT = "a0-hang-pg0-seq42"
NODES = 3


def _store(tmp_path: Path) -> JobVerdictStore:
    return JobVerdictStore(tmp_path / "timeline" / ".jobs", settle=60.0)


def _file_views(store: JobVerdictStore, timeline: Path) -> None:
    """The fallback: every node files its view, nobody first-hand; rank 7 on node 0 is behind."""
    for node in range(NODES):
        store.file(JOB, INCIDENT, node_report(timeline, node, NODES))


def _plant(store: JobVerdictStore, name: str, data: bytes) -> Path:
    path = store.incident_dir(JOB, INCIDENT) / REPORTS_DIR / name
    path.write_bytes(data)
    return path


@pytest.mark.timeout(60)
def test_report_with_garbage_or_huge_ranks_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    timeline = tmp_path / "timeline"
    store = _store(tmp_path)
    _file_views(store, timeline)
    garbage = as_json_doc(node_report(timeline, 5, NODES))
    garbage.update(wall="yesterday", summary=["not", "text"])
    garbage["view"]["ranks"] = "everyone"
    huge = as_json_doc(node_report(timeline, 6, NODES))
    huge["view"]["world_size"] = 10**12  # the analysis would walk a trillion absent ranks
    huge["view"]["waiting"][0]["ranks"][0][0] = 10**15  # its ranks only wait: the compact rows
    huge["view"]["groups"] = {"0": [[0, 10**12]]}
    bad = _plant(store, "rx.R.node-5~e5", json.dumps(garbage).encode())
    big = _plant(store, "rx.R.node-6~e6", json.dumps(huge).encode())
    caplog.set_level(logging.WARNING, "diag.agent.job.verdict")
    v = store.conclude(JOB, INCIDENT, first_seen=0.0, now_wall=time.time(), force=True)
    assert v is not None and (v.culprit, v.culprit_node) == (7, "node-0"), v
    assert str(bad) in caplog.text and "must be a" in caplog.text
    assert str(big) in caplog.text and "out of range" in caplog.text


def test_report_named_with_a_huge_rank_does_not_become_the_culprit(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline"
    store = _store(tmp_path)
    store.file(JOB, INCIDENT, node_report(timeline, 0, NODES, culprit=7))
    forged = as_json_doc(node_report(timeline, 2, NODES))
    forged.update(culprit=10**20, where="L", first_sign_wall=1.0)  # "died first"
    _plant(store, f"r{10**20}.L.node-2~e2", json.dumps(forged).encode())
    v = store.conclude(JOB, INCIDENT, first_seen=0.0, now_wall=time.time(), force=True)
    assert v is not None and (v.culprit, v.culprit_node) == (7, "node-0")


@pytest.mark.timeout(60)
def test_fifo_in_the_reports_directory_does_not_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    timeline = tmp_path / "timeline"
    store = _store(tmp_path)
    _file_views(store, timeline)
    fifo = store.incident_dir(JOB, INCIDENT) / REPORTS_DIR / "rx.R.node-9~e9"
    os.mkfifo(fifo)
    out: list[object] = []
    t = threading.Thread(
        target=lambda: out.append(
            store.conclude(JOB, INCIDENT, first_seen=0.0, now_wall=time.time(), force=True)
        ),
        daemon=True,
    )
    t.start()
    t.join(20)
    if t.is_alive():  # let the blocked open go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("the verdict blocked on a FIFO in the reports directory")
    v = out[0]
    assert v is not None and v.culprit == 7  # type: ignore[attr-defined]
    assert str(fifo) in caplog.text and "FIFO" in caplog.text


def test_oversized_report_is_refused_before_it_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    timeline = tmp_path / "timeline"
    store = _store(tmp_path)
    _file_views(store, timeline)
    path = store.incident_dir(JOB, INCIDENT) / REPORTS_DIR / "rx.R.node-8~e8"
    with path.open("wb") as f:
        f.truncate(MAX_REPORT_BYTES + 1)  # sparse: nothing to read, only a size
    v = store.conclude(JOB, INCIDENT, first_seen=0.0, now_wall=time.time(), force=True)
    assert v is not None and v.culprit == 7
    assert str(path) in caplog.text and "over the" in caplog.text and "limit" in caplog.text


def test_symlinked_incident_directory_is_not_written_through(tmp_path: Path) -> None:
    """A directory planted as a symlink where the incident's reports and claim go: nothing is
    written where it points."""
    store = _store(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store.job_dir(JOB).mkdir(parents=True)
    store.incident_dir(JOB, INCIDENT).symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symlink"):
        store.file(JOB, INCIDENT, node_report(tmp_path / "timeline", 0, NODES, culprit=7))
    assert list(elsewhere.iterdir()) == []


def test_symlinked_reports_directory_is_not_written_through(tmp_path: Path) -> None:
    store = _store(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = store.incident_dir(JOB, INCIDENT)
    d.mkdir(parents=True)
    (d / REPORTS_DIR).symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symlink"):
        store.file(JOB, INCIDENT, node_report(tmp_path / "timeline", 0, NODES, culprit=7))
    assert list(elsewhere.iterdir()) == []
    assert not (d / CLAIM_FILE).exists()


def test_verdict_planted_as_a_symlink_is_not_read_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The verdict's name taken by a symlink to a forged verdict elsewhere: it is neither
    replaced through nor believed."""
    timeline = tmp_path / "timeline"
    store = _store(tmp_path)
    store.file(JOB, INCIDENT, node_report(timeline, 0, NODES, culprit=7))
    forged = tmp_path / "forged.json"
    doc = {
        "format": "diag.job-verdict/1", "incident_id": INCIDENT, "job": JOB, "culprit": 99,
        "culprit_node": "node-x", "basis": "forged", "nodes": [], "evidence": [],
        "first_hand": None, "decided_wall": 1.0,
    }  # fmt: skip
    forged.write_text(json.dumps(doc))
    before = forged.read_bytes()
    (store.incident_dir(JOB, INCIDENT) / JOB_VERDICT_FILE).symlink_to(forged)
    v = store.conclude(JOB, INCIDENT, first_seen=0.0, now_wall=time.time(), force=True)
    assert v is None or v.culprit != 99
    assert forged.read_bytes() == before
    assert JOB_VERDICT_FILE in caplog.text and "symlink" in caplog.text


def test_verdict_with_escaping_evidence_paths_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    d = store.incident_dir(JOB, INCIDENT)
    d.mkdir(parents=True)
    doc = {
        "format": "diag.job-verdict/1", "incident_id": INCIDENT, "job": JOB, "culprit": 3,
        "culprit_node": "n", "basis": "b", "nodes": ["n"], "evidence": ["/etc/.."],
        "first_hand": None, "decided_wall": 1.0,
    }  # fmt: skip
    (d / JOB_VERDICT_FILE).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"{JOB_VERDICT_FILE}.*evidence"):
        store.load(JOB, INCIDENT)
    doc["evidence"] = ["/somewhere/else/20261125-hang-n@job-a0"]
    (d / JOB_VERDICT_FILE).write_text(json.dumps(doc))
    v = store.load(JOB, INCIDENT)
    assert v is not None and v.evidence == (str(tmp_path / "timeline" / "20261125-hang-n@job-a0"),)


def test_timeline_verdict_behind_a_symlink_is_not_taint_evidence(tmp_path: Path) -> None:
    """An incident directory planted as a symlink to a forged one elsewhere does not blame
    this node."""
    timeline = tmp_path / "timeline"
    timeline.mkdir()
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "verdict.json").write_text(json.dumps({"culprit": 3, "node": "me"}))
    (forged / "00003-host.stack.json").write_text("{}")
    (timeline / "20261125-hang-me@x").symlink_to(forged)
    assert from_timeline(timeline, "me", since=0.0) == []


def test_precheck_metrics_with_garbage_are_refused_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "precheck.prom"
    coll = PrecheckFileCollector(path)
    path.write_text(
        "# TYPE diag_precheck_exit_code gauge\n"
        'diag_precheck_exit_code{job="train"} NaN\n'
        'diag_precheck_owned{job="\\u001b]0;x"} 1\n'
    )
    assert list(coll.collect()) == []
    assert str(path) in caplog.text
    path.unlink()
    os.mkfifo(path)  # a FIFO would block the scrape forever
    t = threading.Thread(target=lambda: list(coll.collect()), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("the scrape blocked on a FIFO at the precheck metrics file")
    assert "FIFO" in caplog.text


def test_precheck_textfile_is_not_written_through_a_planted_temp_symlink(tmp_path: Path) -> None:
    path = tmp_path / "precheck.prom"
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    # Where a writer that picks a predictable temp name would write first.
    (tmp_path / f"precheck.prom.{os.getpid()}.{threading.get_ident()}").symlink_to(victim)
    write_textfile(precheck_report(), path)
    assert victim.read_text() == "keep me\n"
    assert b"diag_precheck_exit_code" in path.read_bytes()


class _Metadata(http.server.BaseHTTPRequestHandler):
    token = b"abc\r\nX-Injected: 1"

    def do_PUT(self) -> None:
        self._answer(200, self.token)

    def do_GET(self) -> None:
        self._answer(404, b"")

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/latest/meta-data/spot/instance-action"
    finally:
        server.shutdown()
        server.server_close()


def test_metadata_token_that_would_inject_a_header_is_refused(metadata: str) -> None:
    watcher = NoticeWatcher(NoticeSettings.of(Provider.AWS, metadata, 1.0), lambda n: None)
    with pytest.raises(NoticeFormatError, match="token"):
        watcher.poll_once()


def test_oversized_metadata_answer_is_refused(metadata: str) -> None:
    _Metadata.token = b"x" * (1 << 20)
    try:
        watcher = NoticeWatcher(NoticeSettings.of(Provider.AWS, metadata, 1.0), lambda n: None)
        with pytest.raises(NoticeFormatError, match="over"):
            watcher.poll_once()
    finally:
        _Metadata.token = b"abc\r\nX-Injected: 1"
