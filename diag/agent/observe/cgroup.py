"""The CPU quota and memory limits the kernel enforces on a process, read from its cgroups.

cgroup v2: `cpu.max` ("QUOTA PERIOD" or "max PERIOD"), `memory.max`, `memory.current` and
`memory.stat`'s `inactive_file`. cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none),
`memory.limit_in_bytes` (a huge number: none), `memory.usage_in_bytes` and `memory.stat`'s
`total_inactive_file`. Every level from the process's cgroup up to the root of the mounted
hierarchy counts (a pod-level limit above the container's). Where the hierarchies are mounted,
and which cgroup directory is the process's, come from /proc/PID/mountinfo and /proc/PID/cgroup,
so a container with or without a cgroup namespace, v1, v2 or both (hybrid), is read right.
Anything unreadable is left out: no limit is assumed where none can be read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from diag.agent.observe.containerlimits import ContainerLimits, MemoryLimit

_UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup path mounted (the "root" field of mountinfo)
    point: Path
    v2: bool
    controllers: frozenset[str]


def read_limits(pid: int | str = "self", proc: Path = Path("/proc")) -> ContainerLimits:
    """The limits of process `pid` as this process's view of /proc and the cgroup mounts shows
    them (the agent reads its own: it lives in the sidecar container's cgroup)."""
    base = proc / str(pid)
    mounts = _mounts(base / "mountinfo")
    paths = _cgroup_paths(base / "cgroup")
    quota: float | None = None
    memory: list[MemoryLimit] = []
    version = ""
    v2 = next((m for m in mounts if m.v2), None)
    v2_controllers = _v2_controllers(v2) if v2 is not None else frozenset()
    for controller in ("cpu", "memory"):
        if controller in v2_controllers and "" in paths:
            assert v2 is not None
            dirs = _levels(v2, paths[""])
            version = "cgroup v2"
            if controller == "cpu":
                quota = _min_quota(_v2_quota(d) for d in dirs)
            else:
                memory += [m for d in dirs if (m := _v2_memory(d)) is not None]
            continue
        mount = next((m for m in mounts if not m.v2 and controller in m.controllers), None)
        path = next((p for names, p in paths.items() if controller in names.split(",")), None)
        if mount is None or path is None:
            continue
        dirs = _levels(mount, path)
        version = version or "cgroup v1"
        if controller == "cpu":
            quota = _min_quota(_v1_quota(d) for d in dirs)
        else:
            memory += [m for d in dirs if (m := _v1_memory(d)) is not None]
    return ContainerLimits(
        cpus=_cpus(pid),
        cpu_quota=quota,
        memory=tuple(memory),
        available=_mem_available(proc / "meminfo"),
        source=version,
    )


# -- where the cgroups are --------------------------------------------------------------------


def _mounts(mountinfo: Path) -> list[_Mount]:
    out: list[_Mount] = []
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, after = left.split(), right.split()
        if len(fields) < 5 or len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
            continue
        opts = frozenset(after[2].split(","))
        out.append(
            _Mount(
                root=_unescape(fields[3]),
                point=Path(_unescape(fields[4])),
                v2=after[0] == "cgroup2",
                controllers=opts,
            )
        )
    return out


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _cgroup_paths(cgroup: Path) -> dict[str, str]:
    """controllers ("" for v2, "cpu,cpuacct" for a v1 hierarchy) -> the process's cgroup path."""
    out: dict[str, str] = {}
    try:
        lines = cgroup.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


def _v2_controllers(mount: _Mount) -> frozenset[str]:
    try:
        return frozenset((mount.point / "cgroup.controllers").read_text().split())
    except OSError:
        return frozenset()


def _levels(mount: _Mount, path: str) -> list[Path]:
    """The process's cgroup directory and its ancestors up to the mount point, innermost first.
    A path outside the mounted root (a cgroup namespace shows "/", or a bind-mounted subtree)
    maps to the mount point itself."""
    root = mount.root.rstrip("/")
    inside = path == root or path.startswith(root + "/")
    rel = path[len(root) :].strip("/") if inside else ""
    d = mount.point / rel if rel else mount.point
    if not d.is_dir():
        d = mount.point
    out = [d]
    while d != mount.point and mount.point in d.parents:
        d = d.parent
        out.append(d)
    return out


# -- what they say ------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value) or 0
    return 0


def _v2_quota(d: Path) -> float | None:
    text = _read(d / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    q, p = _int(quota), _int(period) or 100_000
    return q / p if q is not None and q > 0 and p > 0 else None


def _v1_quota(d: Path) -> float | None:
    q, p = _int(_read(d / "cpu.cfs_quota_us")), _int(_read(d / "cpu.cfs_period_us"))
    return q / p if q is not None and q > 0 and p else None


def _min_quota(quotas: Iterable[float | None]) -> float | None:
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _v2_memory(d: Path) -> MemoryLimit | None:
    limit = _int(_read(d / "memory.max"))  # "max" reads as None
    if limit is None or limit >= _UNLIMITED:
        return None
    usage = _int(_read(d / "memory.current")) or 0
    used = max(0, usage - _stat(d / "memory.stat", "inactive_file"))
    return MemoryLimit(limit, used, str(d))


def _v1_memory(d: Path) -> MemoryLimit | None:
    limit = _int(_read(d / "memory.limit_in_bytes"))
    if limit is None or limit >= _UNLIMITED:
        return None
    usage = _int(_read(d / "memory.usage_in_bytes")) or 0
    inactive = _stat(d / "memory.stat", "total_inactive_file") or _stat(
        d / "memory.stat", "inactive_file"
    )
    return MemoryLimit(limit, max(0, usage - inactive), str(d))


def _cpus(pid: int | str) -> int:
    with contextlib.suppress(OSError, ValueError):
        return len(os.sched_getaffinity(0 if pid == "self" else int(pid)))
    return os.cpu_count() or 1


def _mem_available(meminfo: Path) -> int | None:
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None
