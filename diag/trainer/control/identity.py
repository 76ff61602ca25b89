"""Who a rank is to its agent (`ClientIdentity`: job, rank, node, process) and where it says it
resumed from (`ResumeNote`): what the control client sends, as plain data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResumeNote:
    """Where this rank resumed from, for the agent (control.proto's ResumeNote)."""

    source: str
    step: int
    reason: str
    memory_offered: bool
    held: str
    run: str


@dataclass(frozen=True)
class ClientIdentity:
    job: str
    rank: int
    world_size: int
    local_rank: int
    attempt: int
    node: str
    pid: int
    start_time: float = 0.0  # the process's create time: with the PID, the agent watches it
    pid_ns: int = 0  # inode of the process's PID namespace (collector.rundir.pid_namespace)
