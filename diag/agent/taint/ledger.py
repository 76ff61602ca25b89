"""The job's taint ledger in the shared timeline volume: how many nodes a job holds tainted, and
when it tainted them, so the cap and the rate limit hold across all of the job's agents.

    <timeline>/.taints/<job>/
        .lock              fcntl lock held while an agent plans and applies
        <node>.json        one per node the job holds tainted: {"node", "at", "until", "reason"}
        history.jsonl      one line per taint made: {"node", "at"} (the rate limit reads it),
                           trimmed to its retention (count, age, bytes) after each new line

An agent takes the lock, reads the budget, plans, applies and records, then lets go: two agents
of one job cannot both take the last slot. The lock waits at most `timeout` seconds (a hung
filesystem must not stall the agent); on a filesystem without locks it proceeds with a warning.

Every node's agent and every trainer can write the timeline, so the ledger is input too. Its
directories are walked from a descriptor of the timeline without following a symlink; the lock
is opened without following one and must be a regular file (else `LedgerRefused`); claims and
the history are read capped, never blocking on a FIFO, into `Claim` and `HistoryLine`; every
file is written new under a random name and renamed into place, with our modes. A claim that
cannot be read counts as held under its file's name (the cap errs toward fewer taints) and a
history line that is not a taint is dropped, each with one warning naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diag.agent.retention.policy import DEFAULT_HISTORY_RETENTION, Entry, Retention, to_remove
from diag.agent.taint.planner import JobBudget, TaintPlan
from diag.formats.checkedjson import TEXT, Fields
from diag.formats.locks import open_lock_file
from diag.formats.untrusted import (
    KIB,
    MIB,
    MISSING,
    UntrustedInput,
    WarnOnce,
    parse_json,
    read_bounded,
    walk_beneath,
    write_replace,
)

log = logging.getLogger(__name__)
_warn = WarnOnce(log)

LEDGER_DIR = ".taints"
LOCK = ".lock"
HISTORY = "history.jsonl"
CLAIM_SUFFIX = ".json"
HISTORY_MAX_BYTES = 16 * MIB  # far above what retention leaves; a bigger file is not ours
CLAIM_MAX_BYTES = 64 * KIB  # a claim is a few hundred bytes
FILE_MODE = 0o600
DIR_MODE = 0o700


class LedgerBusy(Exception):
    """The ledger cannot be used now (its lock stayed held): nothing is planned or applied."""


class LedgerRefused(LedgerBusy):
    """The ledger's directories or lock are not what agents make (a symlink or a FIFO planted
    in the shared timeline): not used, and as with a busy ledger nothing is planned."""


def _safe(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:200]
    return safe if safe.strip(".") else "_"  # never ".", ".." or empty: one plain name


@dataclass(frozen=True)
class Claim:
    """`<node>.json`: the job holds `node` tainted from `at` until `until` (None: no expiry)."""

    node: str
    at: float
    until: float | None
    reason: str = ""
    incident_id: str = ""

    def held(self, now: float) -> bool:
        return self.until is None or self.until > now

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "node": self.node,
                "at": self.at,
                "until": self.until,
                "reason": self.reason,
                "incident_id": self.incident_id,
            }
        ).encode()

    @classmethod
    def parse(cls, doc: object, source: str, node: str) -> Claim:
        """A claim as `json.loads` gave it; `node` (from the file's name) where it names none.
        UntrustedInput naming `source` when it is not one."""
        f = Fields(doc, source)
        return cls(
            node=f.str("node", node),
            at=f.float("at", 0.0),
            until=f.opt_float("until"),
            reason=f.str("reason", ""),
            incident_id=f.str("incident_id", "", TEXT),
        )


@dataclass(frozen=True)
class HistoryLine:
    """One line of `history.jsonl`: the job tainted `node` at `at`."""

    node: str
    at: float

    def to_line(self) -> str:
        return json.dumps({"node": self.node, "at": self.at}) + "\n"


def parse_history(data: bytes, source: str) -> tuple[tuple[HistoryLine, ...], int]:
    """The taints in a history file's bytes, and how many of its lines were not taints."""
    lines: list[HistoryLine] = []
    bad = 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            f = Fields(parse_json(source, raw), source)
            lines.append(HistoryLine(f.str("node", ""), f.float("at")))
        except UntrustedInput:
            bad += 1
    return tuple(lines), bad


def read_claim(dir_fd: int, name: str, source: Path) -> Claim:
    """The claim `name` in the ledger directory open as `dir_fd` (at `source`, for messages)."""
    try:
        data = read_bounded(name, max_bytes=CLAIM_MAX_BYTES, dir_fd=dir_fd)
    except UntrustedInput as e:
        raise UntrustedInput(source, e.problem) from None
    return Claim.parse(parse_json(source, data), str(source), name[: -len(CLAIM_SUFFIX)])


class TaintLedger:
    def __init__(
        self,
        timeline: Path,
        job: str,
        timeout: float = 30.0,
        history: Retention = DEFAULT_HISTORY_RETENTION,
    ) -> None:
        self.timeline = timeline
        self.job_dir = _safe(job or "default")
        self.dir = timeline / LEDGER_DIR / self.job_dir  # for messages: opened by descriptor
        self.timeout = timeout
        self.history = history
        self._held: int | None = None  # the directory's descriptor while the lock is held

    @contextlib.contextmanager
    def _open(self, create: bool) -> Iterator[int | None]:
        """The ledger's directory (None when it is missing and not `create`). The timeline root
        is the operator's path, followed as given; nothing below it is."""
        if self._held is not None:
            yield self._held
            return
        with contextlib.ExitStack() as stack:
            d: int | None = None
            try:
                if create:
                    self.timeline.mkdir(parents=True, exist_ok=True)
                root = os.open(self.timeline, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                stack.callback(os.close, root)
                d = stack.enter_context(
                    walk_beneath(root, (LEDGER_DIR, self.job_dir), create=create, mode=DIR_MODE)
                )
            except FileNotFoundError:
                if create:
                    raise
            except UntrustedInput as e:
                if create or e.problem != MISSING:
                    raise LedgerRefused(
                        f"the taint ledger {self.dir}: {e.path} {e.problem}; not used "
                        "(remove what was planted there)"
                    ) from None
            yield d

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._open(create=True) as d:
            assert d is not None
            try:
                fd = open_lock_file(LOCK, dir_fd=d, mode=FILE_MODE)
            except UntrustedInput as e:
                raise LedgerRefused(
                    f"the taint ledger's lock {self.dir / LOCK} {e.problem}; not used (remove it)"
                ) from None
            try:
                self._lock(fd)
                self._held = d
                yield
            finally:
                self._held = None
                os.close(fd)

    def _lock(self, fd: int) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
                    log.warning(
                        "the filesystem of %s has no file locks: the job's taint "
                        "cap is not enforced across agents",
                        self.dir,
                    )
                    return
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise LedgerBusy(
                        f"{self.dir / LOCK} stayed locked for {self.timeout:g} s"
                    ) from e
                time.sleep(0.05)

    def budget(self, now: float) -> JobBudget:
        """Nodes held (claims not expired) and the times of the job's taints."""
        with self._open(create=False) as d:
            if d is None:
                return JobBudget()
            held = []
            for name in sorted(os.listdir(d)):
                if name.startswith(".") or not name.endswith(CLAIM_SUFFIX):
                    continue
                try:
                    claim = read_claim(d, name, self.dir / name)
                except UntrustedInput as e:
                    if e.problem == MISSING:
                        continue  # given back since the listing
                    _warn("taint claim %s counted as held: %s", e.path, e.problem)
                    held.append(name[: -len(CLAIM_SUFFIX)])
                    continue
                if claim.held(now):
                    held.append(claim.node)
            times = [line.at for line in self._read_history(d)]
        return JobBudget(tainted_nodes=tuple(held), recent_taints=tuple(times))

    def _read_history(self, d: int) -> tuple[HistoryLine, ...]:
        path = self.dir / HISTORY
        try:
            data = read_bounded(HISTORY, max_bytes=HISTORY_MAX_BYTES, dir_fd=d)
        except UntrustedInput as e:
            if e.problem != MISSING:
                _warn(
                    "taint history %s unreadable, the rate limit starts afresh: %s", path, e.problem
                )
            return ()
        lines, bad = parse_history(data, str(path))
        if bad:
            _warn("taint history %s: lines that are not taints were dropped", path)
        return lines

    def _add_history(self, d: int, line: HistoryLine, now: float) -> None:
        """The history with `line` added and its retention applied, written whole (under the
        lock; a planted file at its name is replaced, never appended to)."""
        lines = (*self._read_history(d), line)
        texts = [x.to_line() for x in lines]
        entries = [
            Entry(str(i), x.at, len(t)) for i, (x, t) in enumerate(zip(lines, texts, strict=True))
        ]
        gone = set(to_remove(entries, self.history, now))
        kept = "".join(t for i, t in enumerate(texts) if str(i) not in gone)
        write_replace(d, HISTORY, kept.encode(), mode=FILE_MODE)

    def record(self, plan: TaintPlan, now: float) -> None:
        """After a plan was applied: take, refresh or give back the node's slot."""
        name = f"{_safe(plan.node)}{CLAIM_SUFFIX}"
        with self._open(create=True) as d:
            assert d is not None
            if plan.record is not None:
                claim = Claim(
                    node=plan.node,
                    at=plan.record.since,
                    until=plan.record.until,
                    reason=plan.record.reason.value,
                    incident_id=plan.record.incident_id,
                )
                write_replace(d, name, claim.to_bytes(), mode=FILE_MODE)
                if plan.claims_budget:
                    self._add_history(d, HistoryLine(plan.node, now), now)
            elif plan.clear_record or plan.removed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=d)
