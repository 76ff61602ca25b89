"""Memory of stack dumps: what one `py-spy dump` of a stuck rank costs, and what an 8-rank
incident takes of the agent's container when every native dump starts at once (one per core, as
the agent did before on any node with 8 cores or more) and when the container's limits bound them.

    python bench/dump_memory.py [--nproc 8] [--limit-mib 1024] [--manifest-mib 2048]   # as root

One N-rank DeepSpeed ZeRO-2 CPU job (gloo, torchrun, journaled by diag.trainer) hangs: the last
rank sleeps before a collective, the others wait in it. Against that same stuck job:

1. each rank dumped alone, Python frames only and `--native`: peak RSS of py-spy (the kernel's
   ru_maxrss of the finished child);
2. a real `diag agent` (`--until incident`) in a fresh memory cgroup without a limit, with
   `--dump-parallel N`: all native dumps at once. Peak RSS of the agent plus its py-spy children
   (sampled every 5 ms), the cgroup's peak usage (page cache included), time to the last stack;
3. under a memory limit of --limit-mib (the shipped manifest had 1 GiB): first the agent's dump
   pass as it ran before (py-spy --native of every rank at once: `dump_all(parallel=N)`, the
   reference), then the agent, whose parallelism now follows the limit. OOM kills, failed dumps,
   native stacks written;
4. the agent under --manifest-mib (the limit deploy/k8s/sidecar/sidecar.yaml ships now).

The agents run with `--dump-parallel N`: on this small VM one dump per usable CPU would be the
bound; N stands for a node with a core per rank, where memory is what bounds it.

The reference's time is its process's wall time (interpreter start included); the agent's is the
verdict's evidence time (Python stacks, then native stacks). Page cache of library files read by
an earlier run stays charged where it was first read, so later runs may show a lower cgroup peak.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from diag.agent.evidence.pyspy import pyspy_binary
from diag.agent.observe.procs import stop_tree
from diag.formats.journalmeta import JOURNAL_SUFFIX, read_meta

JOB = "dumpmem"
MiB = 1 << 20
CGROUP = Path("/sys/fs/cgroup")


# -- a memory cgroup (v2 where its controllers are available, else v1) --------------------------


class MemCgroup:
    def __init__(self, limit: int | None) -> None:
        name = f"diag-bench-{secrets.token_hex(4)}"
        try:
            v2 = "memory" in (CGROUP / "cgroup.controllers").read_text().split()
        except OSError:
            v2 = False
        self.v2 = v2
        self.path = (CGROUP if v2 else CGROUP / "memory") / name
        self.path.mkdir()
        if limit is not None:
            name = "memory.max" if v2 else "memory.limit_in_bytes"
            (self.path / name).write_text(str(limit))
            if not v2:
                # No swap: the limit is the limit (memsw exists only with swap accounting).
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    memsw.write_text(str(limit))

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return -1

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return -1

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def in_cgroup(cg: MemCgroup, cmd: list[str]) -> list[str]:
    """The command, started inside the cgroup before it allocates anything."""
    return ["sh", "-c", f'echo $$ > {cg.procs} && exec "$@"', "sh", *cmd]


# -- sampling a process tree --------------------------------------------------------------------


@dataclass
class TreeSampler:
    pid: int
    peak_total: int = 0  # the process plus its descendants, at the same instant
    peak_self: int = 0
    peak_children: int = 0  # how many descendants at once, at most
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            try:
                own = root.memory_info().rss
                kids = root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            total = own
            for k in kids:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += k.memory_info().rss
            self.peak_total = max(self.peak_total, total)
            self.peak_self = max(self.peak_self, own)
            self.peak_children = max(self.peak_children, len(kids))
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


# -- the stuck job --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stuck_job(work: Path, nproc: int) -> tuple[subprocess.Popen, dict[int, int]]:
    run_dir = work / "run"
    run_dir.mkdir()
    env = dict(
        os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_JOB=JOB, OMP_NUM_THREADS="1",
        TMPDIR=str(work), DIAG_CONTROL="0",
    )  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
        "-m", "diag.trainer.demo_job", "--steps", "1000", "--fault", "hang", "--fault-rank",
        str(nproc - 1), "--fault-step", "8", "--pg-timeout", "3600",
    ]  # fmt: skip
    log = open(work / "job.log", "wb")  # noqa: SIM115 - the job owns it
    job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)  # fmt: skip
    log.close()
    deadline = time.monotonic() + 300
    while "injecting hang" not in (work / "job.log").read_text(errors="replace"):
        if time.monotonic() > deadline or job.poll() is not None:
            raise RuntimeError("the job did not reach its hang; see " + str(work / "job.log"))
        time.sleep(0.5)
    time.sleep(3)  # the others enter the collective
    pids = {}
    for path in run_dir.glob(f"*{JOURNAL_SUFFIX}"):
        meta = read_meta(path)
        pids[meta.rank] = meta.pid
    if len(pids) != nproc:
        raise RuntimeError(f"{len(pids)} journals for {nproc} ranks")
    return job, pids


# -- 1. one dump at a time -----------------------------------------------------------------------


@dataclass
class DumpCost:
    peak_rss: int  # the kernel's ru_maxrss of the finished py-spy
    anon: int  # largest RssAnon sampled while it ran (its own memory)
    file: int  # largest RssFile sampled (mapped library files: page cache, shared)
    seconds: float


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def one_dump(pid: int, native: bool) -> DumpCost:
    """What one py-spy dump of `pid` costs, sampled every ~2 ms while it runs."""
    cmd = [pyspy_binary(), "dump", "--json", "--pid", str(pid)] + (["--native"] if native else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    anon = file = 0
    while True:
        got, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if got:
            break
        st = _status_kib(proc.pid, ("RssAnon", "RssFile"))
        anon = max(anon, st.get("RssAnon", 0))
        file = max(file, st.get("RssFile", 0))
        time.sleep(0.002)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy exited {proc.returncode} on pid {pid}")
    return DumpCost(usage.ru_maxrss * 1024, anon, file, time.monotonic() - t0)


# -- 2 and 3. the agent ----------------------------------------------------------------------------


def run_agent(work: Path, tag: str, cg: MemCgroup, extra: list[str]) -> dict:
    timeline = work / f"timeline-{tag}"
    cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(work / "run"),
        "--timeline", str(timeline), "--job", JOB, "--until", "incident", "--hang-floor", "1",
        "--interval", "0.25", "--native-stacks", "true", "--control",
        "false", "--pyspy-timeout", "60", "-v", *extra,
    ]  # fmt: skip
    log = work / f"agent-{tag}.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        agent = subprocess.Popen(in_cgroup(cg, cmd), stdout=out, stderr=subprocess.STDOUT)
    sampler = TreeSampler(agent.pid).start()
    try:
        rc = agent.wait(300)
    finally:
        sampler.stop()
        if agent.poll() is None:
            stop_tree(agent.pid, grace=5)
    wall = time.monotonic() - t0
    verdicts = sorted(timeline.glob("*/verdict.json"))
    ev = json.loads(verdicts[0].read_text())["evidence"] if verdicts else {}
    stacks = list(verdicts[0].parent.glob("*.stack.json")) if verdicts else []
    native = sum(1 for p in stacks if json.loads(p.read_text()).get("native"))
    return {
        "rc": rc,
        "wall_s": wall,
        "peak_total": sampler.peak_total,
        "peak_agent": sampler.peak_self,
        "peak_children": sampler.peak_children,
        "cgroup_peak": cg.peak(),
        "oom_kills": cg.oom_kills(),
        "parallel": ev.get("native_parallel"),
        "reason": ev.get("native_parallel_reason", ""),
        "stack_seconds": ev.get("stack_seconds"),
        "native_stacks": native,
        "native_failures": ev.get("native_failures", {}),
        "log": str(log),
    }


_REFERENCE = """
import json, sys
from diag.agent.evidence.pyspy import DumpTarget, dump_all
pids = json.loads(sys.argv[1])
targets = [DumpTarget(rank=int(r), world_size=len(pids), pid=p) for r, p in pids.items()]
dumps = dump_all(targets, native=True, timeout=60, parallel=len(targets))
print(json.dumps({d.rank: d.error for d in dumps}))
"""


def run_reference(cg: MemCgroup, pids: dict[int, int]) -> dict:
    """The agent's native dump pass as it ran before: every rank at once."""
    cmd = [sys.executable, "-c", _REFERENCE, json.dumps(pids)]
    t0 = time.monotonic()
    proc = subprocess.Popen(in_cgroup(cg, cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sampler = TreeSampler(proc.pid).start()
    out, err = proc.communicate(timeout=300)
    sampler.stop()
    errors: dict[str, str] = {}
    if proc.returncode == 0:
        errors = json.loads(out.decode().strip().splitlines()[-1])
    return {
        "rc": proc.returncode,
        "wall_s": time.monotonic() - t0,
        "peak_total": sampler.peak_total,
        "peak_children": sampler.peak_children,
        "cgroup_peak": cg.peak(),
        "oom_kills": cg.oom_kills(),
        "failed": sorted(int(r) for r, e in errors.items() if e),
        "native_stacks": sum(1 for e in errors.values() if not e),
        "stderr": err.decode(errors="replace")[-300:],
    }


def mib(n: int | float | None) -> str:
    return "-" if n is None or n < 0 else f"{n / MiB:.0f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--limit-mib", type=int, default=1024, help="the shipped manifest's before")
    p.add_argument("--manifest-mib", type=int, default=2048, help="the shipped manifest's now")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("run as root: the bench puts the agent in memory cgroups of its own", file=sys.stderr)
        return 2
    n = args.nproc
    work = Path(tempfile.mkdtemp(prefix="diag-bench-dumpmem-"))
    print(f"{dt.date.today()} {platform.node()}: {os.cpu_count()} CPUs, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; {n} ranks; work dir {work}")  # fmt: skip
    print(f"starting a {n}-rank job that hangs at step 8 ...", flush=True)
    job, pids = start_stuck_job(work, n)
    cgroups: list[MemCgroup] = []
    try:
        print("1. one dump at a time", flush=True)
        per: dict[bool, list[DumpCost]] = {True: [], False: []}
        for native in (False, True):
            for rank in sorted(pids):
                per[native].append(one_dump(pids[rank], native))
        for native in (False, True):
            costs = per[native]
            name = "py-spy dump --native" if native else "py-spy dump (Python)"
            print(
                f"   {name:22s} peak RSS median {mib(statistics.median(c.peak_rss for c in costs))}"
                f" MiB, max {mib(max(c.peak_rss for c in costs))} MiB; of it anonymous max "
                f"{mib(max(c.anon for c in costs))} MiB, mapped files max "
                f"{mib(max(c.file for c in costs))} MiB; "
                f"{statistics.median(c.seconds for c in costs):.2f} s each"
            )

        print(f"2. the agent, no memory limit, --dump-parallel {n}", flush=True)
        cg = MemCgroup(None)
        cgroups.append(cg)
        free = run_agent(work, "free", cg, ["--dump-parallel", str(n)])
        print(f"   {json.dumps({k: v for k, v in free.items() if k != 'log'})}")

        limit = args.limit_mib * MiB
        print(f"3. under a {args.limit_mib} MiB limit", flush=True)
        cg = MemCgroup(limit)
        cgroups.append(cg)
        ref = run_reference(cg, pids)
        print(f"   reference (all at once): {json.dumps(ref)}")
        cg = MemCgroup(limit)
        cgroups.append(cg)
        ours = run_agent(work, "limited", cg, ["--dump-parallel", str(n)])
        print(f"   agent: {json.dumps({k: v for k, v in ours.items() if k != 'log'})}")

        print(f"4. the agent under the manifest's {args.manifest_mib} MiB", flush=True)
        cg = MemCgroup(args.manifest_mib * MiB)
        cgroups.append(cg)
        manifest = run_agent(work, "manifest", cg, ["--dump-parallel", str(n)])
        print(f"   agent: {json.dumps({k: v for k, v in manifest.items() if k != 'log'})}")

        print()
        print(f"| {n}-rank incident | all at once, no limit (agent) | all at once, "
              f"{args.limit_mib} MiB (before) | bounded, {args.limit_mib} MiB (agent now) | "
              f"agent now, {args.manifest_mib} MiB |")  # fmt: skip
        print("|---|---|---|---|---|")
        rows = [
            ("native dumps at once", free["parallel"], ref["peak_children"], ours["parallel"],
             manifest["parallel"]),
            ("peak RSS, agent + py-spy (MiB)", mib(free["peak_total"]), mib(ref["peak_total"]),
             mib(ours["peak_total"]), mib(manifest["peak_total"])),
            ("peak RSS of the agent alone (MiB)", mib(free["peak_agent"]), "-",
             mib(ours["peak_agent"]), mib(manifest["peak_agent"])),
            ("cgroup peak usage (MiB)", mib(free["cgroup_peak"]), mib(ref["cgroup_peak"]),
             mib(ours["cgroup_peak"]), mib(manifest["cgroup_peak"])),
            ("OOM kills", free["oom_kills"], ref["oom_kills"], ours["oom_kills"],
             manifest["oom_kills"]),
            ("native stacks written", free["native_stacks"], ref["native_stacks"],
             ours["native_stacks"], manifest["native_stacks"]),
            ("verdict -> last stack (s)", free["stack_seconds"], f"{ref['wall_s']:.2f}",
             ours["stack_seconds"], manifest["stack_seconds"]),
        ]  # fmt: skip
        for row in rows:
            print("| " + " | ".join(str(c) for c in row) + " |")
        print(f"\nbounded by ({args.limit_mib} MiB): {ours['reason']}")
        print(f"bounded by ({args.manifest_mib} MiB): {manifest['reason']}")
        ratio = free["peak_total"] / max(1, ours["peak_total"])
        print(f"peak ratio, all at once / bounded: {ratio:.2f}x")
    finally:
        stop_tree(job.pid, grace=5)
        job.wait(30)
        for cg in cgroups:
            cg.remove()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.exit(main())
