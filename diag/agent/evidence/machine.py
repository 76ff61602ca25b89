"""A snapshot of the node and of the rank processes, for an incident's `machine.json`."""

from __future__ import annotations

import os
import platform
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil


@dataclass(frozen=True)
class ProcessSnapshot:
    pid: int
    rank: int
    status: str
    cmdline: str
    create_time: float
    cpu_user: float
    cpu_system: float
    rss_bytes: int
    threads: int
    error: str = ""


@dataclass(frozen=True)
class MachineSnapshot:
    hostname: str
    kernel: str
    taken_at: float  # wall clock
    uptime_s: float
    cpu_count: int
    loadavg: tuple[float, float, float]
    cpu_percent: float
    memory_total: int
    memory_available: int
    swap_used: int
    shm_total: int
    shm_free: int
    disk_free: int  # where the incident is written
    processes: tuple[ProcessSnapshot, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return asdict(self)


def process_snapshot(pid: int, rank: int) -> ProcessSnapshot:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            t = p.cpu_times()
            return ProcessSnapshot(
                pid=pid,
                rank=rank,
                status=p.status(),
                cmdline=" ".join(p.cmdline())[:2000],
                create_time=p.create_time(),
                cpu_user=t.user,
                cpu_system=t.system,
                rss_bytes=p.memory_info().rss,
                threads=p.num_threads(),
            )
    except (psutil.NoSuchProcess, psutil.AccessDenied) as e:
        return ProcessSnapshot(pid, rank, "gone", "", 0.0, 0.0, 0.0, 0, 0, error=type(e).__name__)


def machine_snapshot(ranks: dict[int, int], where: Path) -> MachineSnapshot:
    """`ranks` maps rank -> pid."""
    vm = psutil.virtual_memory()
    try:
        shm = os.statvfs("/dev/shm")
        shm_total, shm_free = shm.f_blocks * shm.f_frsize, shm.f_bavail * shm.f_frsize
    except OSError:
        shm_total = shm_free = 0
    try:
        st = os.statvfs(where)
        disk_free = st.f_bavail * st.f_frsize
    except OSError:
        disk_free = 0
    return MachineSnapshot(
        hostname=socket.gethostname(),
        kernel=platform.release(),
        taken_at=time.time(),
        uptime_s=time.time() - psutil.boot_time(),
        cpu_count=psutil.cpu_count() or 0,
        loadavg=os.getloadavg(),
        cpu_percent=psutil.cpu_percent(interval=None),
        memory_total=vm.total,
        memory_available=vm.available,
        swap_used=psutil.swap_memory().used,
        shm_total=shm_total,
        shm_free=shm_free,
        disk_free=disk_free,
        processes=tuple(process_snapshot(pid, rank) for rank, pid in sorted(ranks.items())),
    )
