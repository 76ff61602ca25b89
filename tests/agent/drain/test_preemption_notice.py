"""The early reclaim notice (diag/agent/drain/notice.py): the parsers on the documented answers, and the
watcher polling a local HTTP server that answers as AWS's (IMDSv2 with a session token, and
IMDSv1) and GCE's metadata servers do. The agent draining on a notice, end to end, is in
tests/system/test_pod_delete.py."""

from __future__ import annotations

import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from metadata_server import ACTION, Metadata

from diag.agent.config import agentconfig as config_mod
from diag.agent.drain.notice import (
    GCE_NOTICE_S,
    Notice,
    NoticeFormatError,
    NoticeSettings,
    NoticeWatcher,
    Provider,
    deadline_of,
    parse_aws,
    parse_gce,
)
from diag.formats.exitcodes import UsageError


@pytest.mark.parametrize(
    ("status", "body", "action", "at"),
    [
        (404, b"<html>Not Found</html>", None, None),
        (200, ACTION, "terminate", 1795508520.0),
        (200, b'{"action": "stop", "time": "2026-11-24T08:22:00.000Z"}', "stop", 1795508520.0),
        (200, b'{"action": "hibernate", "time": "2026-11-24T08:22:00Z"}', "hibernate", None),
    ],
)
def test_parse_aws(status: int, body: bytes, action: str | None, at: float | None) -> None:
    notice = parse_aws(status, body)
    if action is None:
        assert notice is None
        return
    assert notice is not None and notice.action == action
    if at is not None:
        assert notice.reclaim_at == at


@pytest.mark.parametrize(
    ("status", "body"),
    [(200, b"not json"), (200, b'{"action": "terminate"}'), (500, b""), (401, b"")],
)
def test_parse_aws_refuses_what_it_cannot_read(status: int, body: bytes) -> None:
    with pytest.raises(NoticeFormatError):
        parse_aws(status, body)


@pytest.mark.parametrize(
    ("status", "body", "preempted"),
    [(200, b"FALSE", False), (200, b"TRUE", True), (200, b"TRUE\n", True)],
)
def test_parse_gce(status: int, body: bytes, preempted: bool) -> None:
    notice = parse_gce(status, body)
    assert (notice is not None) is preempted


@pytest.mark.parametrize(("status", "body"), [(200, b"maybe"), (403, b""), (503, b"")])
def test_parse_gce_refuses_what_it_cannot_read(status: int, body: bytes) -> None:
    with pytest.raises(NoticeFormatError):
        parse_gce(status, body)


def test_deadlines() -> None:
    aws = Notice(Provider.AWS, "terminate", 1120.0, "")
    assert deadline_of(aws, now_unix=1000.0, now_mono=50.0) == 170.0
    assert deadline_of(aws, now_unix=1200.0, now_mono=50.0) == 50.0  # already past
    gce = Notice(Provider.GCE, "preempted", None, "TRUE")
    assert deadline_of(gce, now_unix=1000.0, now_mono=50.0) == 50.0 + GCE_NOTICE_S
    assert deadline_of(Notice(Provider.AWS, "stop", None, ""), 0.0, 0.0) is None


@pytest.fixture
def metadata():
    servers: list[Metadata] = []

    def make(**kw) -> Metadata:  # type: ignore[no-untyped-def]
        servers.append(Metadata(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _watch(settings: NoticeSettings) -> tuple[NoticeWatcher, list[Notice]]:
    got: list[Notice] = []
    return NoticeWatcher(settings, got.append).start(), got


def _until(pred, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.mark.parametrize("imdsv2", [True, False])
def test_aws_watcher_polls_until_an_interruption_is_scheduled(metadata, imdsv2: bool) -> None:
    md = metadata(imdsv2=imdsv2)
    url = md.aws_url
    watcher, got = _watch(NoticeSettings.of(Provider.AWS, url, 0.1))
    try:
        assert _until(lambda: sum(r[0] == "GET" for r in md.requests) >= 3)
        assert got == [], "404: nothing scheduled"
        md.scheduled = True
        assert _until(lambda: bool(got))
        assert got[0].action == "terminate" and got[0].reclaim_at == 1795508520.0
        polls = len(md.requests)
        time.sleep(0.5)
        assert len(md.requests) == polls, "one notice, then the watcher stops"
    finally:
        watcher.close()
    gets = [h for m, _, h in md.requests if m == "GET"]
    if imdsv2:
        assert all(h.get("x-aws-ec2-metadata-token") == "TOKEN-1" for h in gets)
        puts = [r for r in md.requests if r[0] == "PUT"]
        assert len(puts) == 1, "the session token is reused"
    else:
        assert all("x-aws-ec2-metadata-token" not in h for h in gets)


def test_gce_watcher(metadata) -> None:
    md = metadata()
    url = md.gce_url
    watcher, got = _watch(NoticeSettings.of(Provider.GCE, url, 0.1))
    try:
        assert _until(lambda: len(md.requests) >= 3)
        assert got == []
        md.scheduled = True
        assert _until(lambda: bool(got))
        assert got[0].provider == Provider.GCE and got[0].action == "preempted"
    finally:
        watcher.close()
    assert all(h.get("metadata-flavor") == "Google" for _, _, h in md.requests)


def test_watcher_survives_a_server_that_is_not_there(caplog) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as s:
        port = s.server_port  # closed at once: nothing listens there any more
    url = f"http://127.0.0.1:{port}/computeMetadata/v1/instance/preempted"
    watcher, got = _watch(NoticeSettings.of(Provider.GCE, url, 0.05))
    try:
        assert _until(lambda: "cannot read" in caplog.text)
        time.sleep(0.3)
        assert got == []
        assert caplog.text.count("cannot read") == 1, "warned once, not every poll"
    finally:
        watcher.close()


def _load(*argv: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    import argparse

    p = argparse.ArgumentParser()
    config_mod.add_arguments(p)
    return config_mod.load(p.parse_args(list(argv)), env=env or {})


def test_agent_options() -> None:
    cfg = _load()
    assert cfg.drain is not None and (cfg.drain.grace, cfg.drain.margin) == (30.0, 3.0)
    assert cfg.notice is None
    cfg = _load("--termination-grace", "60", env={"DIAG_TERMINATION_GRACE": "10"})
    assert cfg.drain is not None and cfg.drain.grace == 60.0  # flags before the environment
    cfg = _load(env={"DIAG_TERMINATION_GRACE": "10", "DIAG_DRAIN_MARGIN": "1"})
    assert cfg.drain is not None and (cfg.drain.grace, cfg.drain.margin) == (10.0, 1.0)
    assert _load("--drain", "false").drain is None
    cfg = _load("--preemption-notice", "aws")
    assert cfg.notice is not None and cfg.notice.url.endswith("/spot/instance-action")
    cfg = _load("--preemption-notice", "gce", "--notice-url", "http://127.0.0.1:1/p")
    assert cfg.notice is not None and cfg.notice.url == "http://127.0.0.1:1/p"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--termination-grace", "5", "--drain-margin", "5"), "shorter than the termination"),
        (("--termination-grace", "0"), "must be > 0"),
        (("--notice-url", "http://x/y"), "--preemption-notice is none"),
        (("--preemption-notice", "aws", "--notice-url", "ftp://x"), "not an http"),
        (("--preemption-notice", "azure"), "not one of"),
    ],
)
def test_bad_agent_options_are_clear_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises((UsageError, SystemExit)) as e:
        _load(*argv)
    if isinstance(e.value, UsageError):
        assert message in str(e.value)
