"""Host and agent-process metrics, read with psutil and statvfs at scrape time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import psutil
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from diag.agent.metrics import families as f

SHM = Path("/dev/shm")
_IDLE_FIELDS = ("idle", "iowait")


def _version() -> str:
    try:
        return version("diag")
    except PackageNotFoundError:
        return "unknown"


class HostCollector(Collector):
    """CPU, memory and /dev/shm of the host; CPU and memory of the agent itself."""

    def __init__(self, node: str, shm: Path = SHM) -> None:
        self.node = node
        self.shm = shm
        self.me = psutil.Process()
        self.version = _version()

    def collect(self) -> Iterator[Metric]:
        labels = [self.node]
        cpu = psutil.cpu_times()
        busy = sum(v for k, v in cpu._asdict().items() if k not in _IDLE_FIELDS)
        # Linux counts guest time inside user time already.
        busy -= getattr(cpu, "guest", 0.0) + getattr(cpu, "guest_nice", 0.0)
        yield _one(f.HOST_CPU_BUSY, labels, busy)
        yield _one(f.HOST_CPU_CORES, labels, psutil.cpu_count() or 0)
        vm = psutil.virtual_memory()
        yield _one(f.HOST_MEM_TOTAL, labels, vm.total)
        yield _one(f.HOST_MEM_AVAILABLE, labels, vm.available)
        try:
            st = os.statvfs(self.shm)
        except OSError:
            pass  # no /dev/shm in this container: the families stay absent
        else:
            yield _one(f.HOST_SHM_USED, labels, (st.f_blocks - st.f_bfree) * st.f_frsize)
            yield _one(f.HOST_SHM_FREE, labels, st.f_bavail * st.f_frsize)
        with self.me.oneshot():
            t = self.me.cpu_times()
            rss = self.me.memory_info().rss
        yield _one(f.AGENT_RSS, labels, rss)
        yield _one(f.AGENT_CPU, labels, t.user + t.system)
        yield _one(f.AGENT_INFO, [self.node, self.version], 1)


def _one(family: f.Family, labels: list[str], value: float) -> Metric:
    m = family.new()
    m.add_metric(labels, value)
    return m
