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
from pathlib import Path

from diag.agent.retention import DEFAULT_HISTORY_RETENTION, Entry, Retention, to_remove
from diag.agent.taint.planner import JobBudget, TaintPlan
from diag.formats.untrusted import MIB, UntrustedInput, open_dir, read_bounded, write_replace

log = logging.getLogger(__name__)

LEDGER_DIR = ".taints"
HISTORY = "history.jsonl"
HISTORY_MAX_BYTES = 16 * MIB  # far above what retention leaves; a bigger file is not ours


class LedgerBusy(Exception):
    pass


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:200] or "_"


class TaintLedger:
    def __init__(
        self,
        timeline: Path,
        job: str,
        timeout: float = 30.0,
        history: Retention = DEFAULT_HISTORY_RETENTION,
    ) -> None:
        self.dir = timeline / LEDGER_DIR / _safe(job or "default")
        self.timeout = timeout
        self.history = history

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
                        log.warning(
                            "the filesystem of %s has no file locks: the job's taint "
                            "cap is not enforced across agents",
                            self.dir,
                        )
                        break
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise LedgerBusy(
                            f"{self.dir / '.lock'} stayed locked for {self.timeout:g} s"
                        ) from e
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    def budget(self, now: float) -> JobBudget:
        """Nodes held (claims not expired) and the times of the job's taints."""
        held = []
        if self.dir.is_dir():
            for path in sorted(self.dir.glob("*.json")):
                try:
                    doc = json.loads(path.read_text())
                except (OSError, ValueError):
                    log.warning("unreadable taint claim %s: counted as held", path)
                    held.append(path.stem)
                    continue
                until = doc.get("until")
                if until is None or float(until) > now:
                    held.append(str(doc.get("node", path.stem)))
        times = [at for at, _ in self._history()]
        return JobBudget(tainted_nodes=tuple(held), recent_taints=tuple(times))

    def _history(self) -> list[tuple[float, str]]:
        """(time, line) of each readable line of the history."""
        path = self.dir / HISTORY
        try:
            data = read_bounded(path, max_bytes=HISTORY_MAX_BYTES)
        except UntrustedInput as e:
            if "does not exist" not in e.problem:
                log.warning("taint history unreadable, rate limit starts afresh: %s", e)
            return []
        out = []
        for line in data.decode("utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                out.append((float(json.loads(line)["at"]), line))
        return out

    def _trim_history(self, now: float) -> None:
        """Applies the history's retention (under the lock, after a new line)."""
        lines = self._history()
        entries = [Entry(str(i), at, len(line) + 1) for i, (at, line) in enumerate(lines)]
        gone = set(to_remove(entries, self.history, now))
        if not gone:
            return
        kept = "".join(line + "\n" for i, (_, line) in enumerate(lines) if str(i) not in gone)
        fd = open_dir(self.dir)
        try:
            write_replace(fd, HISTORY, kept.encode(), mode=0o600)
        finally:
            os.close(fd)

    def record(self, plan: TaintPlan, now: float) -> None:
        """After a plan was applied: take, refresh or give back the node's slot."""
        path = self.dir / f"{_safe(plan.node)}.json"
        if plan.record is not None:
            doc = {
                "node": plan.node,
                "at": plan.record.since,
                "until": plan.record.until,
                "reason": plan.record.reason.value,
                "incident_id": plan.record.incident_id,
            }
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc))
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
            if plan.claims_budget:
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                with os.fdopen(os.open(self.dir / HISTORY, flags, 0o600), "a") as f:
                    f.write(json.dumps({"node": plan.node, "at": now}) + "\n")
                self._trim_history(now)
        elif plan.clear_record or plan.removed:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
