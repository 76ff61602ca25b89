"""The agent's CPU per poll: a real `diag agent` watching N busy ranks (journal writers doing
collectives and steps at a steady pace) for a fixed time; its CPU time (user + sys, children
included: its dump helper) divided by the polls it made. Side by side in one run: the code of
another checkout (--base, e.g. a worktree of an earlier commit) and this one, rounds alternating.

    python bench/agent_poll.py --base /work/wt/base --ranks 8 --seconds 20 --rounds 3

Modes of this checkout's agent: `root` (ranks as root, the agent stays root) and, with
`--dropped`, `dropped` (ranks as uid 65534, the agent started as root with --trainer-uid 65534:
it runs as that user with a root dump helper beside it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


@dataclass(frozen=True)
class Sample:
    mode: str
    cpu_s: float
    polls: float

    @property
    def ms_per_poll(self) -> float:
        return 1000 * self.cpu_s / self.polls


def _rank(run_dir: Path, rank: int, world: int, uid: int, ops_per_s: float) -> int:
    from diag.formats.journalmeta import GroupInfo, JournalMeta, journal_path, write_meta
    from diag.formats.journalwriter import JournalWriter
    from diag.formats.records import DType, OpCode, OpFlag, OpState

    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if uid:
            os.setgroups([uid])
            os.setgid(uid)
            os.setuid(uid)
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable, as a trainer started as its user
        w = JournalWriter(journal_path(run_dir, "bench", rank), rank=rank, world_size=world,
                          local_rank=rank)  # fmt: skip
        meta = JournalMeta(
            job="bench", rank=rank, world_size=world, local_rank=rank, local_world_size=world,
            pid=os.getpid(), pid_start_time=psutil.Process().create_time(), node="n",
            groups=(GroupInfo(0, "default_pg", tuple(range(world))),),
        )  # fmt: skip
        write_meta(w.path, meta)
        seq, step = 0, 0
        while True:
            seq += 1
            t = time.monotonic_ns()
            s = w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 0, -1, seq, 4096, t)
            w.update(s, OpState.COMPLETED, t_start_ns=t, t_end_ns=time.monotonic_ns())
            if seq % 10 == 0:
                step += 1
                w.step(step)
            time.sleep(1 / ops_per_s)
    finally:
        os._exit(code)


def _cpu(pid: int) -> float:
    p = psutil.Process(pid)
    t = p.cpu_times()
    total = t.user + t.system
    for c in p.children(recursive=True):
        try:
            ct = c.cpu_times()
            total += ct.user + ct.system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(mode: str, checkout: Path, args: argparse.Namespace) -> Sample:
    dropped = mode == "dropped"
    uid = NOBODY if dropped else 0
    base = Path(tempfile.mkdtemp(prefix="diag-bench-poll-", dir="/dev/shm"))
    os.chmod(base, 0o711)
    ranks: list[int] = []
    agent = None
    try:
        run_dir, timeline = base / "run", base / "tl"
        for d in (run_dir, timeline):
            d.mkdir(mode=0o700)
            os.chown(d, uid, uid)
        ranks = [_rank(run_dir, r, args.ranks, uid, args.ops) for r in range(args.ranks)]
        time.sleep(1.0)
        env = dict(os.environ)
        if checkout != REPO:
            pkg = base / "pkg" / "diag"
            pkg.mkdir(parents=True)
            for room in ("agent", "cli", "collector", "formats", "proto", "trainer", "viewer"):
                (pkg / room).symlink_to(checkout / room)
            env["PYTHONPATH"] = str(pkg.parent)
        env.pop("DIAG_STATE_DIR", None)
        cmd = [sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
               "--timeline", str(timeline), "--interval", str(args.interval), "--control", "false",
               "--drain", "false", "--job", "bench"]  # fmt: skip
        if checkout == REPO:
            cmd += ["--state-dir", str(base / "state")]
        if dropped:
            cmd += ["--trainer-uid", str(NOBODY)]
        agent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(args.warm)
        c0, t0 = _cpu(agent.pid), time.monotonic()
        time.sleep(args.seconds)
        c1, t1 = _cpu(agent.pid), time.monotonic()
        if agent.poll() is not None:
            raise SystemExit(f"{mode}: the agent exited: {agent.stderr.read().decode()[-2000:]}")
        return Sample(mode, c1 - c0, (t1 - t0) / args.interval)
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--ops", type=float, default=50.0, help="collectives per second per rank")
    parser.add_argument("--interval", type=float, default=0.1, help="the agent's --interval")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warm", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dropped", action="store_true", help="also this checkout, dropped")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the ranks and the agent change users")
    modes = [("base", args.base.resolve(), "root"), ("this", REPO, "root")]
    if args.dropped:
        modes.append(("this", REPO, "dropped"))
    samples: dict[str, list[Sample]] = {}
    for r in range(args.rounds):
        for name, checkout, mode in modes:
            s = measure(mode, checkout, args)
            key = f"{name} ({mode})"
            samples.setdefault(key, []).append(s)
            print(f"round {r + 1}: {key}: {s.ms_per_poll:.3f} ms CPU per poll", flush=True)
    base = statistics.median(s.ms_per_poll for s in samples["base (root)"])
    print(f"\n| agent | ms CPU per poll (median of {args.rounds}) | x base |")
    print("|---|---|---|")
    for key, ss in samples.items():
        m = statistics.median(s.ms_per_poll for s in ss)
        print(f"| {key} | {m:.3f} | {m / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
