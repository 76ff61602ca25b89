"""Early notice of a reclaim: the cloud's metadata server says an instance is about to go before
Kubernetes sends SIGTERM, and the agent starts its drain then.

- AWS spot: `GET /latest/meta-data/spot/instance-action` answers 404 until an interruption is
  scheduled, then 200 with `{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}` (two
  minutes ahead). IMDSv2 needs a session token first (`PUT /latest/api/token`); an instance that
  still allows IMDSv1 answers without one.
- GCE: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` answers
  `FALSE`, and `TRUE` once the instance is being preempted (30 s before it stops).

The parsers are pure (status and body in, a Notice or None out); `NoticeWatcher` is the thread
that polls.
"""

from __future__ import annotations

import calendar
import enum
import http.client
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from diag.formats.untrusted import printable

log = logging.getLogger(__name__)

AWS_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
GCE_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
AWS_TOKEN_PATH = "/latest/api/token"
AWS_TOKEN_TTL_S = 21600
GCE_NOTICE_S = 30.0  # a preempted GCE instance gets 30 s before it is stopped
HTTP_TIMEOUT_S = 2.0
# The answers are a few dozen bytes; whatever answers at the URL gets no more than this read.
MAX_BODY_BYTES = 64 * 1024
AWS_ACTIONS = frozenset({"terminate", "stop", "hibernate"})
_TOKEN = re.compile(r"^[A-Za-z0-9+/=_.-]{1,1024}$")  # goes into a header: no CR/LF, no spaces


class Provider(enum.Enum):
    NONE = "none"
    AWS = "aws"
    GCE = "gce"


@dataclass(frozen=True)
class NoticeSettings:
    provider: Provider
    url: str
    interval: float = 5.0

    @classmethod
    def of(cls, provider: Provider, url: str | None, interval: float) -> NoticeSettings:
        url = url or (AWS_URL if provider == Provider.AWS else GCE_URL)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{url!r} is not an http(s) URL")
        return cls(provider, url, interval)


@dataclass(frozen=True)
class Notice:
    provider: Provider
    action: str  # "terminate", "stop", "hibernate"; "preempted" on GCE
    reclaim_at: float | None  # unix time the instance goes, when the cloud says
    detail: str  # the response, for the log

    def describe(self) -> str:
        when = ""
        if self.reclaim_at is not None:
            when = " at " + time.strftime("%H:%M:%SZ", time.gmtime(self.reclaim_at))
        return f"{self.provider.value} reclaim notice: {self.action}{when}"


class NoticeFormatError(ValueError):
    pass


def parse_aws(status: int, body: bytes) -> Notice | None:
    """The instance-action answer: 404 means none scheduled."""
    if status == 404:
        return None
    if status != 200:
        raise NoticeFormatError(f"HTTP {status}")
    try:
        doc = json.loads(body)
        action = doc["action"]
        stamp = doc["time"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise NoticeFormatError(f"not an instance-action document: {body[:200]!r}") from None
    if (
        not isinstance(action, str)
        or action not in AWS_ACTIONS
        or not isinstance(stamp, str)
        or len(stamp) > 64
    ):
        raise NoticeFormatError(f"not an instance-action document: {body[:200]!r}")
    return Notice(
        Provider.AWS, action, _parse_time(stamp), printable(body[:1024].decode(errors="replace"))
    )


def read_body(resp: Any) -> bytes:
    """At most MAX_BODY_BYTES of an answer; a longer one is not a metadata server's."""
    body = resp.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        raise NoticeFormatError(f"an answer of over {MAX_BODY_BYTES} bytes")
    return body


def parse_token(body: bytes) -> str:
    """An IMDSv2 token: it is sent back in a header, so only token characters pass."""
    text = body.decode("ascii", errors="replace").strip()
    if _TOKEN.match(text) is None:
        raise NoticeFormatError(f"not a metadata token: {body[:80]!r}")
    return text


def parse_gce(status: int, body: bytes) -> Notice | None:
    if status != 200:
        raise NoticeFormatError(f"HTTP {status}")
    text = body.decode(errors="replace").strip().upper()
    if text == "FALSE":
        return None
    if text == "TRUE":
        return Notice(Provider.GCE, "preempted", None, "TRUE")
    raise NoticeFormatError(f"expected TRUE or FALSE, got {body[:200]!r}")


def _parse_time(stamp: str) -> float:
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return float(calendar.timegm(time.strptime(stamp, fmt)))
        except ValueError:
            continue
    raise NoticeFormatError(f"unreadable time {stamp!r}")


def deadline_of(notice: Notice, now_unix: float, now_mono: float) -> float | None:
    """The monotonic time the instance goes (None: not said, the grace period applies)."""
    if notice.reclaim_at is not None:
        return now_mono + max(0.0, notice.reclaim_at - now_unix)
    if notice.provider == Provider.GCE:
        return now_mono + GCE_NOTICE_S
    return None


class NoticeWatcher:
    """Polls the metadata URL every `interval` seconds on a thread of its own and calls
    `on_notice` once, with the first notice."""

    def __init__(self, settings: NoticeSettings, on_notice: Callable[[Notice], None]) -> None:
        self.settings = settings
        self.on_notice = on_notice
        self.notice: Notice | None = None
        self._stop = threading.Event()
        self._token: str | None = None
        self._token_until = 0.0
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="diag-notice", daemon=True)

    def start(self) -> NoticeWatcher:
        log.info(
            "watching %s for a reclaim notice every %g s",
            self.settings.url, self.settings.interval,
        )  # fmt: skip
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(HTTP_TIMEOUT_S * 2 + 1)

    def poll_once(self) -> Notice | None:
        status, body = self._get()
        if self.settings.provider == Provider.AWS:
            return parse_aws(status, body)
        return parse_gce(status, body)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self.poll_once()
                self._failures = 0
            except (OSError, NoticeFormatError, http.client.HTTPException) as e:
                self._failures += 1
                # Once, then every 60 polls: a metadata server that is not there (not on that
                # cloud, blocked by a network policy) must not flood the log.
                if self._failures == 1 or self._failures % 60 == 0:
                    log.warning(
                        "reclaim notice: cannot read %s (%s); set --preemption-notice none if "
                        "this node is not on %s", self.settings.url, e,
                        self.settings.provider.value,
                    )  # fmt: skip
                notice = None
            if notice is not None:
                self.notice = notice
                log.warning("%s (%s)", notice.describe(), notice.detail)
                self.on_notice(notice)
                return
            self._stop.wait(self.settings.interval)

    def _get(self) -> tuple[int, bytes]:
        headers = {}
        if self.settings.provider == Provider.GCE:
            headers["Metadata-Flavor"] = "Google"
        else:
            token = self._aws_token()
            if token:
                headers["X-aws-ec2-metadata-token"] = token
        req = urllib.request.Request(self.settings.url, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
                return resp.status, read_body(resp)
        except urllib.error.HTTPError as e:
            return e.code, read_body(e)

    def _aws_token(self) -> str | None:
        """An IMDSv2 session token (None where the server has no token endpoint: IMDSv1)."""
        now = time.monotonic()
        if self._token and now < self._token_until:
            return self._token
        parts = urlsplit(self.settings.url)
        url = urlunsplit((parts.scheme, parts.netloc, AWS_TOKEN_PATH, "", ""))
        req = urllib.request.Request(
            url,
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
        )
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
                self._token = parse_token(read_body(resp))
            self._token_until = now + AWS_TOKEN_TTL_S / 2
        except urllib.error.HTTPError:
            self._token = None  # no token endpoint: ask again now and then
            self._token_until = now + 60.0
        return self._token
