"""Reading a process's CPU quota and memory limits from its cgroups.

- On a real cgroup: the test creates a nested cgroup (a pod-like parent with a memory limit and a
  CPU quota, a container-like child with a looser memory limit), moves a real process into the
  child, lets it allocate, and reads the process's limits the way the agent reads its own (v2
  when this machine's cgroup2 hierarchy has the memory and cpu controllers, else v1; skipped
  where cgroups cannot be created).
- On trees laid out like cgroupfs (the same file names and formats, under a temporary directory):
  the layouts this machine cannot show, cgroup v2 with and without a cgroup namespace, v1 with
  combined controllers and a container's subtree mounted at the root, a hybrid host, and a
  cgroup with no limit at all.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diag.agent.observe.cgroup import read_limits

MiB = 1 << 20
GiB = 1 << 30
CGROUP = Path("/sys/fs/cgroup")

pytestmark = pytest.mark.timeout(60)


# -- a real cgroup ----------------------------------------------------------------------------


def _v2_ready() -> bool:
    try:
        have = set((CGROUP / "cgroup.controllers").read_text().split())
    except OSError:
        return False
    return {"memory", "cpu"} <= have


def _make(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.mkdir()
        except OSError as e:
            pytest.skip(f"cannot create a cgroup here ({e})")


def _remove(dirs: list[Path]) -> None:
    """Removes the test's cgroups, innermost first (the process in them is gone by then)."""
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)  # the dead process is still being released


_ALLOCATE = """
import sys
ballast = bytearray(96 << 20)
ballast[:: 4096] = b"x" * len(ballast[:: 4096])   # touch every page: charged to our cgroup
print("ready", flush=True)
sys.stdin.readline()
"""


def test_limits_of_a_process_in_a_real_cgroup() -> None:
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    name = f"diag-test-{secrets.token_hex(4)}"
    v2 = _v2_ready()
    if v2:
        pod, ctr = CGROUP / name, CGROUP / name / "ctr"
        created = [pod, ctr]
        _make([pod])
        (pod / "cgroup.subtree_control").write_text("+memory +cpu")
        _make([ctr])
        (pod / "memory.max").write_text(str(768 * MiB))
        (pod / "cpu.max").write_text("150000 100000")
        (ctr / "memory.max").write_text(str(2 * GiB))
        homes = [ctr]
    else:
        if not (CGROUP / "memory" / "tasks").exists() or not (CGROUP / "cpu").is_dir():
            pytest.skip("no cgroup v1 memory and cpu hierarchies")
        mem_pod, cpu_pod = CGROUP / "memory" / name, CGROUP / "cpu" / name
        mem_ctr = mem_pod / "ctr"
        created = [mem_pod, mem_ctr, cpu_pod]
        _make(created)
        (mem_pod / "memory.limit_in_bytes").write_text(str(768 * MiB))
        (mem_ctr / "memory.limit_in_bytes").write_text(str(2 * GiB))
        (cpu_pod / "cpu.cfs_period_us").write_text("100000")
        (cpu_pod / "cpu.cfs_quota_us").write_text("150000")
        homes = [mem_ctr, cpu_pod]
    proc = subprocess.Popen(
        [sys.executable, "-c", _ALLOCATE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        for home in homes:
            (home / "cgroup.procs").write_text(str(proc.pid))
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

        got = read_limits(proc.pid)

        assert got.source == ("cgroup v2" if v2 else "cgroup v1")
        assert got.cpu_quota == pytest.approx(1.5)
        assert got.cpus == len(os.sched_getaffinity(proc.pid))
        # Both levels, the container's first; the pod's is the tighter one.
        assert [m.limit for m in got.memory] == [2 * GiB, 768 * MiB]
        inner = got.memory[0]
        assert inner.where.endswith(f"{name}/ctr")
        assert 90 * MiB <= inner.used < 600 * MiB, inner  # the ballast, and the interpreter
        assert got.available is not None and got.available > 0
    finally:
        proc.kill()
        proc.wait(10)
        _remove(created)


# -- trees laid out like cgroupfs -----------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _proc(tmp: Path, mountinfo: list[str], cgroup: str, meminfo_kb: int = 8 << 20) -> Path:
    proc = tmp / "proc"
    _write(
        proc,
        {
            "self/mountinfo": "\n".join(mountinfo) + "\n",
            "self/cgroup": cgroup,
            "meminfo": f"MemTotal: 16000000 kB\nMemAvailable: {meminfo_kb} kB\n",
        },
    )
    return proc


def _mi(n: int, root: str, point: Path, fstype: str, opts: str) -> str:
    return f"{n} 1 0:{n} {root} {point} rw,nosuid - {fstype} {fstype} {opts}"


def test_v2_in_a_cgroup_namespace(tmp_path: Path) -> None:
    """A pod's container with its own cgroup namespace: /proc/self/cgroup says "0::/" and the
    container's cgroup is mounted at /sys/fs/cgroup."""
    fs = tmp_path / "sys/fs/cgroup"
    _write(
        fs,
        {
            "cgroup.controllers": "cpuset cpu io memory pids",
            "cpu.max": "200000 100000",
            "memory.max": str(1 * GiB),
            "memory.current": str(300 * MiB),
            "memory.stat": f"anon {200 * MiB}\nfile {100 * MiB}\ninactive_file {80 * MiB}\n",
        },
    )
    proc = _proc(tmp_path, [_mi(30, "/", fs, "cgroup2", "rw,nsdelegate")], "0::/\n")
    got = read_limits("self", proc)
    assert got.source == "cgroup v2"
    assert got.cpu_quota == 2.0
    assert [(m.limit, m.used) for m in got.memory] == [(1 * GiB, 220 * MiB)]
    assert got.available == (8 << 20) * 1024


def test_v2_without_namespace_walks_up_to_the_pod(tmp_path: Path) -> None:
    """The host's view: the process sits deep in the hierarchy; the pod level above the
    container has the tighter memory limit and the CPU quota; "max" means no limit."""
    fs = tmp_path / "sys/fs/cgroup"
    pod = "kubepods.slice/kubepods-pod1.slice"
    ctr = f"{pod}/cri-containerd-abc.scope"
    _write(
        fs,
        {
            "cgroup.controllers": "cpu memory",
            f"{pod}/cpu.max": "50000 100000",
            f"{pod}/memory.max": str(512 * MiB),
            f"{pod}/memory.current": str(400 * MiB),
            f"{pod}/memory.stat": "inactive_file 0\n",
            f"{ctr}/cpu.max": "max 100000",
            f"{ctr}/memory.max": "max",
            f"{ctr}/memory.current": str(100 * MiB),
            "kubepods.slice/memory.max": "max",
        },
    )
    proc = _proc(tmp_path, [_mi(30, "/", fs, "cgroup2", "rw")], f"0::/{ctr}\n")
    got = read_limits("self", proc)
    assert got.cpu_quota == 0.5
    assert [(m.limit, m.used) for m in got.memory] == [(512 * MiB, 400 * MiB)]
    assert got.memory[0].where == str(fs / pod)


def test_v1_combined_controllers_and_a_subtree_mounted_at_the_root(tmp_path: Path) -> None:
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the full path,
    the container's own directory is what is mounted (mountinfo's root field says which)."""
    base = tmp_path / "sys/fs/cgroup"
    cpu, mem = base / "cpu,cpuacct", base / "memory"
    path = "/kubepods/burstable/pod1/abc"
    _write(
        base,
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "memory/memory.limit_in_bytes": str(1 * GiB),
            "memory/memory.usage_in_bytes": str(500 * MiB),
            "memory/memory.stat": f"cache 1\ninactive_file 9\ntotal_inactive_file {100 * MiB}\n",
        },
    )
    mountinfo = [
        _mi(40, path, cpu, "cgroup", "rw,cpu,cpuacct"),
        _mi(41, path, mem, "cgroup", "rw,memory"),
    ]
    cgroup = f"5:memory:{path}\n3:cpu,cpuacct:{path}\n1:name=systemd:{path}\n"
    got = read_limits("self", _proc(tmp_path, mountinfo, cgroup))
    assert got.source == "cgroup v1"
    assert got.cpu_quota is None  # -1: no quota
    assert [(m.limit, m.used) for m in got.memory] == [(1 * GiB, 400 * MiB)]


def test_hybrid_host_reads_v1_and_no_limit_reads_as_none(tmp_path: Path) -> None:
    """cgroup2 mounted with no controllers (systemd's hybrid layout) leaves limits to v1; a
    v1 limit of LONG_MAX (page-rounded) is no limit at all."""
    base = tmp_path / "sys/fs/cgroup"
    _write(
        base,
        {
            "unified/cgroup.controllers": "",
            "memory/memory.limit_in_bytes": "9223372036854771712",
            "memory/memory.usage_in_bytes": str(5 * GiB),
            "cpu/cpu.cfs_quota_us": "300000",
            "cpu/cpu.cfs_period_us": "100000",
        },
    )
    mountinfo = [
        _mi(31, "/", base / "cpu", "cgroup", "rw,cpu"),
        _mi(35, "/", base / "memory", "cgroup", "rw,memory"),
        _mi(41, "/", base / "unified", "cgroup2", "rw"),
    ]
    got = read_limits("self", _proc(tmp_path, mountinfo, "4:memory:/\n1:cpu:/\n0::/\n"))
    assert got.source == "cgroup v1"
    assert got.cpu_quota == 3.0
    assert got.memory == ()


def test_nothing_readable_means_no_limits(tmp_path: Path) -> None:
    got = read_limits("self", _proc(tmp_path, [], ""))
    assert (got.source, got.cpu_quota, got.memory) == ("", None, ())
    assert got.cpus >= 1
