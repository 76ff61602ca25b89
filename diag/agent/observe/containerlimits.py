"""The CPU and memory limits a container runs under, as plain data: `cgroup` reads them from the
kernel, `evidence.parallelism` decides from them how many stack dumps may run at once. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryLimit:
    """One level of the cgroup hierarchy that limits memory (the container's, the pod's...)."""

    limit: int  # bytes
    used: int  # bytes in use that cannot be reclaimed at once (usage minus inactive file cache)
    where: str = ""  # the cgroup directory, for messages

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class ContainerLimits:
    cpus: int  # CPUs this process may run on (its affinity: cpuset, taskset)
    cpu_quota: float | None = None  # cores per scheduling period, None: no quota
    memory: tuple[MemoryLimit, ...] = ()  # every limited level, the innermost first
    available: int | None = None  # host memory available to new allocations, if known
    source: str = ""  # "cgroup v2", "cgroup v1" or "" (none found), for messages
