"""What the ranks tell the agent beside persist requests, and what the agent tells them about
replication:

- the node a rank says it runs on, checked against the agent's own at its registration: the
  agent replicates only its own node's snapshots, and a replaced node finds its replica only
  under the same name, so a mismatch is named at once (and counted);
- a rank completed a snapshot: replication sends a round's step at once (agent.replica);
- where a rank resumed from: a resume from storage while a step was in memory (the node's own,
  or pulled from a peer) is logged with what each rank held, once per launch, and counted;
- replication's state for the ranks (on, and the round step every holder of the node holds),
  sent to each rank when it subscribes and whenever the holders take a newer round step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from diag.agent.checkpoint.sessions import RankKey, Sessions
from diag.formats.journalmeta import safe_job_name
from diag.formats.refusals import printable

log = logging.getLogger(__name__)

MAX_NOTE_TEXT = 2048  # a resume's reason and held steps, as logged


@dataclass(frozen=True)
class ReplicaState:
    """Replication of this node, as the ranks are told: the newest round step (-1: none) every
    holder holds, of launch `run`."""

    step: int = -1
    run: str = ""


@dataclass(frozen=True)
class Resume:
    """Where a rank resumed from, as it said (text already bounded and printable)."""

    job: str
    rank: int
    source: str
    step: int
    reason: str
    memory_offered: bool
    held: str
    run: str


class RankNotes:
    def __init__(self, node: str, sessions: Sessions) -> None:
        self.node = node
        self.sessions = sessions
        # The replication's state when this node replicates (None: it does not).
        self.replica: Callable[[], ReplicaState] | None = None
        self.on_saved: list[Callable[[str, int, int], None]] = []  # (job, rank, step)
        self._lock = threading.Lock()
        self._mismatched: set[str] = set()
        self._resumes: set[tuple[str, str]] = set()  # (job, run) already logged
        self.mismatches = 0  # registrations of ranks naming another node
        self.fallbacks = 0  # launches that resumed from storage with a step in memory
        self.last_resume: Resume | None = None

    def registered(self, key: RankKey, node: str) -> None:
        """A rank registered saying it runs on `node`."""
        if not node or not self.node or node == self.node:
            return
        with self._lock:
            self.mismatches += 1
            first = node not in self._mismatched
            self._mismatched.add(node)
        if first:
            log.error(
                "rank %d of %s says it runs on node %r, but this agent is node %r: its "
                "snapshots are not replicated to peers, and a replacement of this node would "
                "not find them; give DIAG_NODE the same value in the trainer's and the agent's "
                "environment (the worker's place in the job, e.g. worker-0, not the host name)",
                key.rank, key.job, printable(node)[:256], self.node,
            )  # fmt: skip

    def saved(self, key: RankKey, step: int) -> None:
        for hook in list(self.on_saved):
            try:
                hook(key.job, key.rank, step)
            except Exception:  # a hook's failure is logged, never the rank's call
                log.exception("handling rank %d's completed snapshot failed", key.rank)

    def resumed(self, r: Resume) -> None:
        with self._lock:
            self.last_resume = r
            seen = (r.job, r.run) in self._resumes
            self._resumes.add((r.job, r.run))
            fallback = r.memory_offered and r.source != "memory" and not seen
            if fallback:
                self.fallbacks += 1
        if fallback:
            log.warning(
                "the ranks of %s resumed from %s, not from memory, although steps were in "
                "memory: %s (held: %s)",
                r.job, f"storage step {r.step}" if r.step >= 0 else "nothing", r.reason, r.held,
            )  # fmt: skip
        elif not seen:
            log.info("the ranks of %s resumed from %s%s (%s)", r.job, r.source,
                     f" step {r.step}" if r.step >= 0 else "", r.reason)  # fmt: skip

    def replica_message(self) -> object | None:
        """The AgentMessage telling a rank replication's state, or None when this node does not
        replicate."""
        if self.replica is None:
            return None
        from diag.proto import control_pb2 as pb

        s = self.replica()
        return pb.AgentMessage(replica_ack=pb.ReplicaAck(on=True, step=s.step, run=s.run))

    def confirmed(self, job: str) -> None:
        """Every holder of this node took a newer round step: tell the job's ranks."""
        msg = self.replica_message()
        if msg is None:
            return
        for rank in self.sessions.of_job(safe_job_name(job)):
            self.sessions.post(RankKey(safe_job_name(job), rank), msg)


def bounded(text: str) -> str:
    """A rank's free text, as the agent logs it."""
    return printable(text[:MAX_NOTE_TEXT], keep_newlines=False)
