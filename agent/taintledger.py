"""The job's taint ledger in the shared timeline volume: how many nodes a job holds tainted, and
when it tainted them, so the cap and the rate limit hold across all of the job's agents.

    <timeline>/.taints/<job>/
        .lock              fcntl lock held while an agent plans and applies
        <node>.json        one per node the job holds tainted: {"node", "at", "until", "reason"}
        history.jsonl      one line per taint made: {"node", "at"} (the rate limit reads it)

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

from diag.agent.taints import JobBudget, TaintPlan

log = logging.getLogger(__name__)

LEDGER_DIR = ".taints"
HISTORY = "history.jsonl"


class LedgerBusy(Exception):
    pass


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:200] or "_"


class TaintLedger:
    def __init__(self, timeline: Path, job: str, timeout: float = 30.0) -> None:
        self.dir = timeline / LEDGER_DIR / _safe(job or "default")
        self.timeout = timeout

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
        times: list[float] = []
        with contextlib.suppress(FileNotFoundError):
            for line in (self.dir / HISTORY).read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    times.append(float(json.loads(line)["at"]))
        return JobBudget(tainted_nodes=tuple(held), recent_taints=tuple(times))

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
                with open(self.dir / HISTORY, "a") as f:
                    f.write(json.dumps({"node": plan.node, "at": now}) + "\n")
        elif plan.clear_record or plan.removed:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
