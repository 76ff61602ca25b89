"""What the agent knows about its ranks at one instant: plain data for the decision core.

Times are seconds on the monotonic clock shared by every process of the node (CLOCK_MONOTONIC),
so the agent can compare a trainer's timestamps with its own `now`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from diag.agent.detect.cadence import Cadence
from diag.formats.records import P2P_OPS, OpCode, OpState


class Liveness(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"  # exited after closing its journal normally
    FAILED = "failed"  # exited through an uncaught exception (the journal says so)
    DIED = "died"  # the process is gone without a word: killed, crashed, os._exit


_RUNNING = Liveness.RUNNING  # a module global: `alive` is asked 128,000 times and more


@dataclass(frozen=True)
class OpView:
    group: str  # the process group's name, identical on all member ranks
    group_seq: int
    op: OpCode
    state: OpState
    nbytes: int
    t_enqueue: float
    t_end: float | None = None
    peer: int = -1  # global rank of the p2p peer
    on_device: bool = False  # tracked by CUDA events: STARTED means the device began it

    @property
    def pending(self) -> bool:
        return self.state.pending

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_OPS  # asked for each of 128,000 ranks in a job's analysis

    def describe(self) -> str:
        if self.op == OpCode.SEND:
            peer = f" to rank {self.peer}"
        elif self.op.is_p2p:
            peer = f" from rank {self.peer}" if self.peer >= 0 else " from any rank"
        else:
            peer = ""
        return f"{self.op.label} #{self.group_seq} of group {self.group}{peer}"


@dataclass(frozen=True)
class Paced:
    """One interval of a rank's recent pace: a step (end to end) or a completed op."""

    what: str  # "step 31", "all_reduce #12 of group 0"
    start: float
    seconds: float


@dataclass(frozen=True)
class RankSnapshot:
    rank: int
    local_rank: int
    pid: int
    node: str
    liveness: Liveness
    started_at: float  # when its journal was created
    last_activity: float  # newest sign of progress: an op issued or finished, a step, a phase
    step: int  # completed training steps
    phase: str = ""  # innermost open phase, "" outside phases
    phase_since: float | None = None
    exited_at: float | None = None  # when the agent saw the process end
    left_group: bool = False  # CLOSED when it destroyed its process group (it may run on)
    pending: tuple[OpView, ...] = ()  # unfinished ops, oldest first
    last_ops: Mapping[str, OpView] = field(default_factory=dict)  # newest collective per group
    # Recent point-to-point ops per (group, peer), issued or finished, oldest first. Their
    # sequence numbers count the pair's ops (sends and receives alike), so #k of one side
    # matches #k of the other.
    p2p: Mapping[tuple[str, int], tuple[OpView, ...]] = field(default_factory=dict)
    step_durations: tuple[float, ...] = ()  # recent completed steps, oldest first
    max_op_seconds: float = 0.0  # longest completed op seen recently
    proc_state: str = ""  # /proc state letter: R, S, D, Z, T ...
    cpu_busy: float = 0.0  # share of one core used since the last observation
    # Since when the process and its children have used next to no CPU and it has moved next to
    # no bytes (observe/idleness.py); None: busy, or not known (another node's rank, a PID this
    # agent cannot see).
    idle_since: float | None = None
    cadence: Cadence | None = None  # pace of its ops while it has marked no step (cadence.py)
    # This launch's own steps: a restarted or resumed rank counts its step from the checkpoint,
    # but its start-up is as long as the first launch's. None: unknown (only `step` is).
    launch_steps: int | None = None
    launch_step_ends: tuple[float, ...] = ()  # when this launch's first steps ended
    pace: tuple[Paced, ...] = ()  # this launch's recent steps, then its recent completed ops

    @property
    def alive(self) -> bool:
        return self.liveness is _RUNNING

    @property
    def oldest_pending(self) -> OpView | None:
        return self.pending[0] if self.pending else None


@dataclass(frozen=True)
class Observation:
    now: float
    ranks: tuple[RankSnapshot, ...]
    groups: Mapping[str, tuple[int, ...]]  # group name -> global ranks of its members
    world_size: int
    attempt: int = 0
    # The newest world the ranks formed in place within the attempt (diag.trainer.resilient);
    # 0: the first, or no wrapper.
    world: int = 0
    pg_timeout: float = 0.0  # the collective timeout torch enforces, 0 if unknown
    group_timeouts: Mapping[str, float] = field(default_factory=dict)  # per group, when known
    recent_ops: Mapping[int, tuple[OpView, ...]] = field(default_factory=dict)  # rank -> done ops
    job: str = ""  # the job of the ranks' journals
    # Ranks on other nodes, as their agents saw them (nodeview.py): hints for the culprit
    # analysis only; an agent judges and acts on its own ranks.
    remote: tuple[RankSnapshot, ...] = ()

    def rank(self, rank: int) -> RankSnapshot | None:
        """A local rank."""
        for r in self.ranks:
            if r.rank == rank:
                return r
        return None

    def find(self, rank: int) -> RankSnapshot | None:
        """A local rank, else one another node's agent saw."""
        found = self.rank(rank)
        if found is None:
            for r in self.remote:
                if r.rank == rank:
                    return r
        return found

    @property
    def all_ranks(self) -> tuple[RankSnapshot, ...]:
        return self.ranks + self.remote
