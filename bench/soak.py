"""Soak: healthy but irregular multi-rank CPU DeepSpeed jobs, each watched by a real `diag agent`
with its default limits, must raise no incident; and the reverse, every fault kind the agent
knows, injected into real jobs, must be detected, named and attributed to the right rank.

    python bench/soak.py healthy --job-minutes 60 --parallel 3 --out soak-out
    python bench/soak.py faults --repeat 5 --out faults-out

healthy: jobs run `parallel` at a time until their summed wall time (launch to exit) reaches
--job-minutes. Each job draws its mix from a seeded generator: 2-4 ranks, ZeRO 1-3, a slow first
step, a straggler, uneven data-loader stalls, long eval phases, flash checkpoints persisted by the
agent and plain DeepSpeed checkpoints; a noisy neighbour burns CPU in bursts all along. Any
incident is printed with its evidence directory, and the run exits 1.

faults: each kind is injected --repeat times (see FAULT_KINDS) into a real job under a real agent;
for each it prints how many were detected and attributed to the injected rank, and the median and
worst time from the fault to the verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diag.agent.observe.procs import stop_tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SOAK_JOB = HERE / "soak_job.py"
WAIT_JOB = REPO / "tests" / "support" / "jobs" / "wait_job.py"
JOB = "soak"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(root: Path) -> dict[str, str]:
    run_dir = root / "run"
    for d in (run_dir, root / "timeline", root / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_JOB=JOB, OMP_NUM_THREADS="1",
        TMPDIR=str(root / "tmp"),
    )  # fmt: skip
    env.pop("DIAG_TIMELINE", None)
    return env


def _agent_cmd(root: Path, *extra: str) -> list[str]:
    # The agent's default limits (floor 10 s, 5 x step, ceiling 300 s, warm-up 900 s): the soak
    # checks what a user gets without tuning.
    return [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(root / "run"),
        "--timeline", str(root / "timeline"), "--job", JOB, "--until", "job-end", "-v", *extra,
    ]  # fmt: skip


def _torchrun(nproc: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
    ]  # fmt: skip


def incidents(timeline: Path) -> list[Path]:
    if not timeline.is_dir():
        return []
    return sorted(
        d for d in timeline.iterdir()
        if d.is_dir() and not d.name.startswith(".") and (d / "verdict.json").exists()
    )  # fmt: skip


# ---------------------------------------------------------------------------- healthy soak


@dataclass(frozen=True)
class Mix:
    """One healthy job's irregularities."""

    seed: int
    nproc: int
    zero: int
    seconds: float
    first_step_delay: float
    straggler_rank: int
    straggle: float
    stall_prob: float
    stall_max: float
    eval_every: int
    eval_seconds: float
    flash_every: int
    persist_every: int
    save_every: int

    @classmethod
    def draw(cls, seed: int, seconds: tuple[float, float]) -> Mix:
        r = random.Random(seed)
        nproc = r.choice((2, 3, 3, 4))
        return cls(
            seed=seed,
            nproc=nproc,
            zero=r.choice((1, 2, 3)),
            seconds=round(r.uniform(*seconds)),
            first_step_delay=r.choice((0.0, 15.0, 40.0)),
            straggler_rank=r.choice((-1, r.randrange(nproc))),
            straggle=round(r.uniform(0.2, 1.0), 2),
            stall_prob=r.choice((0.0, 0.03, 0.08)),
            stall_max=round(r.uniform(1.0, 5.0), 1),
            eval_every=r.choice((0, 25, 40)),
            eval_seconds=round(r.uniform(12.0, 45.0)),
            flash_every=r.choice((0, 5, 10)),
            persist_every=r.choice((2, 3)),
            save_every=r.choice((0, 0, 30)),
        )

    def job_args(self, save_dir: Path) -> list[str]:
        return [
            "--seconds", str(self.seconds), "--zero", str(self.zero), "--seed", str(self.seed),
            "--first-step-delay", str(self.first_step_delay), "--straggler-rank",
            str(self.straggler_rank), "--straggle", str(self.straggle), "--stall-prob",
            str(self.stall_prob), "--stall-max", str(self.stall_max), "--eval-every",
            str(self.eval_every), "--eval-seconds", str(self.eval_seconds), "--flash-every",
            str(self.flash_every), "--persist-every", str(self.persist_every), "--save-every",
            str(self.save_every), "--save-dir", str(save_dir),
        ]  # fmt: skip

    def describe(self) -> str:
        parts = [f"{self.nproc} ranks ZeRO-{self.zero} {self.seconds:.0f}s"]
        if self.first_step_delay:
            parts.append(f"first step +{self.first_step_delay:.0f}s")
        if self.straggler_rank >= 0:
            parts.append(f"straggler r{self.straggler_rank} +{self.straggle}s/step")
        if self.stall_prob:
            parts.append(f"stalls p={self.stall_prob} <={self.stall_max}s")
        if self.eval_every:
            parts.append(f"eval {self.eval_seconds:.0f}s/{self.eval_every} steps")
        if self.flash_every:
            parts.append(f"flash/{self.flash_every} persist/{self.persist_every}")
        if self.save_every:
            parts.append(f"ds save/{self.save_every}")
        return ", ".join(parts)


@dataclass
class JobRun:
    mix: Mix
    root: Path
    job: subprocess.Popen
    agent: subprocess.Popen
    started: float
    logs: tuple
    ended: float | None = None

    def poll(self) -> bool:
        """True once the job and its agent are over (the agent is stopped if it lingers)."""
        if self.job.poll() is None:
            return False
        if self.ended is None:
            self.ended = time.monotonic()
        if self.agent.poll() is None and time.monotonic() - self.ended < 30:
            return False
        if self.agent.poll() is None:
            stop_tree(self.agent.pid, grace=5)
            self.agent.wait(timeout=20)
        for f in self.logs:
            f.close()
        return True

    def stop(self) -> None:
        for proc in (self.job, self.agent):
            if proc.poll() is None:
                stop_tree(proc.pid, grace=5)
                proc.wait(timeout=20)
        for f in self.logs:
            f.close()


def start_job(mix: Mix, root: Path) -> JobRun:
    root.mkdir(parents=True, exist_ok=True)
    env = _env(root)
    (root / "mix.json").write_text(json.dumps(asdict(mix)))
    alog, jlog = open(root / "agent.log", "wb"), open(root / "job.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        _agent_cmd(root), env=env, stdout=alog, stderr=subprocess.STDOUT, start_new_session=True
    )
    job = subprocess.Popen(
        [*_torchrun(mix.nproc), str(SOAK_JOB), *mix.job_args(root / "ckpt")],
        env=env, stdout=jlog, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return JobRun(mix, root, job, agent, time.monotonic(), (alog, jlog))


NOISE = """
import os, random, time
r = random.Random(os.getpid())
while True:
    end = time.monotonic() + r.uniform(5, 40)
    while time.monotonic() < end:
        sum(i * i for i in range(10000))
    time.sleep(r.uniform(2, 30))
"""


@contextlib.contextmanager
def noisy_neighbour(procs: int):
    """Processes that burn CPU in bursts of 5-40 s, 2-30 s apart, next to the jobs."""
    started = [
        subprocess.Popen([sys.executable, "-c", NOISE], start_new_session=True)
        for _ in range(procs)
    ]
    try:
        yield
    finally:
        for p in started:
            p.kill()
            p.wait(timeout=10)


@dataclass
class SoakResult:
    jobs: int = 0
    job_seconds: float = 0.0
    failed_jobs: list[str] = field(default_factory=list)
    incidents: list[str] = field(default_factory=list)
    mixes: list[str] = field(default_factory=list)


def soak(
    out: Path,
    job_minutes: float,
    parallel: int,
    seconds: tuple[float, float] = (180.0, 420.0),
    seed: int = 1,
    noise: int = 1,
    log=print,
) -> SoakResult:
    """Healthy jobs, `parallel` at a time, until their summed wall time reaches `job_minutes`."""
    out.mkdir(parents=True, exist_ok=True)
    result = SoakResult()
    running: list[JobRun] = []
    launched = 0
    t0 = last = time.monotonic()

    def budget_left() -> float:
        # Job time already done plus what the running jobs will add (their planned length).
        planned = sum(j.mix.seconds + 30 for j in running)
        return job_minutes * 60 - result.job_seconds - planned

    with noisy_neighbour(noise):
        try:
            while True:
                while len(running) < parallel and budget_left() > 0:
                    mix = Mix.draw(seed * 10_000 + launched, seconds)
                    launched += 1
                    run = start_job(mix, out / f"job{launched:03d}")
                    log(f"[soak] job{launched:03d} start: {mix.describe()}")
                    running.append(run)
                for run in list(running):
                    if not run.poll():
                        continue
                    running.remove(run)
                    _finish(run, result, log)
                if not running:
                    break
                if time.monotonic() - last >= 30:
                    last = time.monotonic()
                    live = result.job_seconds + sum(last - j.started for j in running)
                    log(
                        f"[soak] {last - t0:6.0f}s wall, job time {live / 60:5.1f} min, "
                        f"{result.jobs} done, {len(running)} running, "
                        f"{len(result.incidents)} incidents, {len(result.failed_jobs)} failed"
                    )
                time.sleep(1.0)
        finally:
            for run in running:
                run.stop()
    (out / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def _finish(run: JobRun, result: SoakResult, log) -> None:
    name = run.root.name
    secs = (run.ended or time.monotonic()) - run.started
    result.jobs += 1
    result.job_seconds += secs
    result.mixes.append(f"{name}: {run.mix.describe()}")
    found = incidents(run.root / "timeline")
    for inc in found:
        v = json.loads((inc / "verdict.json").read_text())
        result.incidents.append(f"{name}: {v.get('summary')} [evidence: {inc}]")
        log(f"[soak] INCIDENT in {name}: {v.get('summary')}\n        evidence: {inc}")
    if run.job.returncode != 0:
        result.failed_jobs.append(f"{name}: exit {run.job.returncode} [{run.root / 'job.log'}]")
        log(f"[soak] {name} FAILED with exit code {run.job.returncode}; see {run.root}/job.log")
    log(
        f"[soak] {name} done in {secs:.0f}s, exit {run.job.returncode}, agent exit "
        f"{run.agent.returncode}, {len(found)} incidents"
    )


# --------------------------------------------------------------------------- injected faults


@dataclass(frozen=True)
class FaultKind:
    name: str
    what: str
    verdict: str | None  # the verdict kind expected; None: no incident (a straggler progresses)
    suspect: str | None  # the lead suspect's kind expected


FAULT_KINDS = (
    FaultKind("hang", "a rank stops in Python (sleeps) before its next collective", "hang", "behind"),
    FaultKind("gil", "a rank spins in C holding the GIL (a catastrophic regex)", "hang", "behind"),
    FaultKind("exit", "a rank is SIGKILLed (dead rank, like the OOM killer)", "rank_exited", "died"),
    FaultKind("straggler", "a rank sleeps 0.2-0.9 s more per step: slow, progressing", None, None),
    FaultKind("groups", "deadlock across two process groups (one rank takes the other group)",
              "hang", "deadlock"),
    FaultKind("p2p", "p2p cycle: both partners receive first", "hang", "deadlock"),
    FaultKind("pipeline", "pipeline stages waiting on each other", "hang", "deadlock"),
    FaultKind("stepless", "a rank of a job that marks no steps stops issuing collectives",
              "hang", "behind"),
)  # fmt: skip
KINDS = {k.name: k for k in FAULT_KINDS}


@dataclass
class Trial:
    kind: str
    rank: int
    detected: bool = False
    named: bool = False  # the verdict (and lead suspect) of the kind expected
    attributed: bool = False  # the culprit is the injected rank
    seconds: float | None = None  # fault -> verdict (straggler: -> named in the metrics)
    summary: str = ""
    evidence: str = ""

    @property
    def ok(self) -> bool:
        return self.detected and self.named and self.attributed


def _fault_wall(log: Path, pattern: str) -> float | None:
    times = [float(t) for t in re.findall(pattern, log.read_text(errors="replace"))]
    return min(times) if times else None


def _watch(root: Path, job_cmd: list[str], agent_extra: tuple[str, ...], timeout: float,
           until=None) -> tuple[subprocess.Popen, subprocess.Popen]:  # fmt: skip
    """Runs the agent (until its first incident) and the job until the agent exits, `until()`
    holds or `timeout` passes; stops both."""
    env = _env(root)
    agent_cmd = _agent_cmd(root, "--on-hang", "stop", "--stop-grace", "5", *agent_extra)
    agent_cmd[agent_cmd.index("job-end")] = "incident"
    with open(root / "agent.log", "wb") as alog, open(root / "job.log", "wb") as jlog:
        agent = subprocess.Popen(
            agent_cmd, env=env, stdout=alog, stderr=subprocess.STDOUT, start_new_session=True
        )
        job = subprocess.Popen(
            job_cmd, env=env, stdout=jlog, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and agent.poll() is None and job.poll() is None:
                if until is not None and until():
                    break
                time.sleep(0.5)
            # A job that ended (a dead rank takes torchrun down): give the agent its moment.
            if job.poll() is not None and agent.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(timeout=30)
        finally:
            # The agent first: a job stopped under its eyes would be an incident of its own.
            for proc in (agent, job):
                if proc.poll() is None:
                    stop_tree(proc.pid, grace=5)
                proc.wait(timeout=20)
    return job, agent


def _judge(trial: Trial, root: Path, fault_at: float | None) -> Trial:
    kind = KINDS[trial.kind]
    found = incidents(root / "timeline")
    if not found:
        trial.summary = f"no incident; see {root}"
        return trial
    v = json.loads((found[0] / "verdict.json").read_text())
    trial.detected = True
    trial.summary = str(v.get("summary"))
    trial.evidence = str(found[0])
    lead = (v.get("suspects") or [{}])[0]
    trial.named = v.get("kind") == kind.verdict and lead.get("kind") == kind.suspect
    trial.attributed = v.get("culprit") == trial.rank
    if fault_at is not None and v.get("detected_at"):
        import datetime as dt

        trial.seconds = dt.datetime.fromisoformat(v["detected_at"]).timestamp() - fault_at
    return trial


def _straggler_named(port: int, rank: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return False

    def gauge(name: str) -> dict[int, float]:
        out = {}
        for m in re.finditer(name + r"\{([^}]*)\} ([0-9.eE+-]+)", text):
            rm = re.search(r'rank="(\d+)"', m.group(1))
            if rm:
                out[int(rm.group(1))] = float(m.group(2))
        return out

    score, share = gauge("diag_rank_straggler_score"), gauge("diag_rank_straggler_wait_share")
    # The agent's own test (diag/agent/detect/straggler.py): most of the waiting, 10 % of the wall time.
    return score.get(rank, 0.0) >= 0.1 and share.get(rank, 0.0) >= 0.5


def run_trial(kind: str, rank: int, nproc: int, root: Path, seed: int = 1) -> Trial:
    """Injects one fault of `kind` on `rank` of a real `nproc`-rank job under a real agent."""
    root.mkdir(parents=True, exist_ok=True)
    trial = Trial(kind, rank)
    r = random.Random(seed)
    log = root / "job.log"
    if kind in ("hang", "gil", "exit"):
        job = [
            *_torchrun(nproc), "-m", "diag.trainer.demo_job", "--steps", "2000", "--zero",
            str(r.choice((1, 2, 3))), "--hidden", "64", "--fault", kind, "--fault-rank",
            str(rank), "--fault-step", str(r.randrange(6, 13)), "--pg-timeout", "300",
        ]  # fmt: skip
        _watch(root, job, (), timeout=240)
        return _judge(trial, root, _fault_wall(log, r"injecting \w+ at ([0-9.]+)"))
    if kind in ("groups", "p2p", "pipeline", "stepless"):
        job = [
            *_torchrun(nproc), str(WAIT_JOB), "--scenario", kind, "--fault-rank", str(rank),
            "--fault-step", str(r.randrange(5, 10)), "--fault-after", "45", "--pg-timeout", "300",
        ]  # fmt: skip
        _watch(root, job, (), timeout=240)
        return _judge(trial, root, _fault_wall(log, r"wait_job rank \d+: .* at ([0-9.]+)"))
    if kind == "straggler":
        port = _free_port()
        job = [
            *_torchrun(nproc), str(SOAK_JOB), "--seconds", "600", "--zero",
            str(r.choice((1, 2, 3))), "--straggler-rank", str(rank), "--straggle",
            str(round(r.uniform(0.4, 0.6), 2)), "--seed", str(seed),
        ]  # fmt: skip
        named_at: list[float] = []

        def named() -> bool:
            if _straggler_named(port, rank):
                named_at.append(time.time())
                return True
            return False

        _watch(root, job, ("--metrics-port", str(port)), timeout=240, until=named)
        start = _fault_wall(log, r"straggling from ([0-9.]+)")
        found = incidents(root / "timeline")
        trial.detected = bool(named_at)
        trial.named = trial.attributed = bool(named_at) and not found
        trial.summary = (
            f"named rank {rank} a straggler in the metrics, no incident"
            if named_at and not found
            else f"named: {bool(named_at)}, incidents: {len(found)}; see {root}"
        )
        if named_at and start is not None:
            trial.seconds = named_at[0] - start
        return trial
    raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")


def fault_rank(kind: str, nproc: int, r: random.Random) -> int:
    if kind == "p2p":
        return 2 * r.randrange(nproc // 2)  # the lower partner changes its order
    if kind == "pipeline":
        return r.randrange(nproc - 1)  # the last stage has no gradient to wait for
    return r.randrange(nproc)


def faults(out: Path, kinds: list[str], repeat: int, nproc: int, parallel: int, seed: int = 1,
           log=print) -> list[Trial]:  # fmt: skip
    from concurrent.futures import ThreadPoolExecutor

    r = random.Random(seed)
    plan = [
        (kind, i, fault_rank(kind, nproc, r), r.randrange(10**6))
        for i in range(repeat)
        for kind in kinds
    ]

    def one(item: tuple[str, int, int, int]) -> Trial:
        kind, i, rank, s = item
        t = run_trial(kind, rank, nproc, out / f"{kind}-{i:02d}", seed=s)
        secs = "-" if t.seconds is None else f"{t.seconds:.1f}s"
        log(f"[faults] {kind} #{i} rank {rank}: {'ok' if t.ok else 'FAIL'} {secs} {t.summary}")
        return t

    with ThreadPoolExecutor(parallel) as pool:
        trials = list(pool.map(one, plan))
    (out / "trials.json").write_text(json.dumps([asdict(t) for t in trials], indent=1))
    return trials


def fault_table(trials: list[Trial]) -> str:
    rows = [
        "| fault kind | injected | detected | named | attributed | median s | worst s |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in FAULT_KINDS:
        ts = [t for t in trials if t.kind == kind.name]
        if not ts:
            continue
        secs = [t.seconds for t in ts if t.seconds is not None]
        med = f"{statistics.median(secs):.1f}" if secs else "-"
        worst = f"{max(secs):.1f}" if secs else "-"
        rows.append(
            f"| {kind.name}: {kind.what} | {len(ts)} | {sum(t.detected for t in ts)} | "
            f"{sum(t.named for t in ts)} | {sum(t.attributed for t in ts)} | {med} | {worst} |"
        )
    return "\n".join(rows)


# ------------------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("healthy")
    h.add_argument("--job-minutes", type=float, default=60.0)
    h.add_argument("--parallel", type=int, default=3)
    h.add_argument("--min-seconds", type=float, default=180.0)
    h.add_argument("--max-seconds", type=float, default=420.0)
    h.add_argument("--seed", type=int, default=1)
    h.add_argument("--noise", type=int, default=1, help="noisy-neighbour processes")
    h.add_argument("--out", type=Path, default=None)
    f = sub.add_parser("faults")
    f.add_argument("--kinds", default=",".join(KINDS), help="comma-separated")
    f.add_argument("--repeat", type=int, default=5)
    f.add_argument("--nproc", type=int, default=4)
    f.add_argument("--parallel", type=int, default=2, help="trials at once")
    f.add_argument("--seed", type=int, default=1)
    f.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if a.cmd == "faults":
        kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            p.error(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
        out = a.out or Path(tempfile.mkdtemp(prefix="diag-faults-"))
        t0 = time.monotonic()
        trials = faults(
            out, kinds, a.repeat, a.nproc, a.parallel, a.seed, log=lambda s: print(s, flush=True)
        )
        print(f"\n{len(trials)} faults injected into {a.nproc}-rank jobs in "
              f"{(time.monotonic() - t0) / 60:.1f} min; results in {out}\n")  # fmt: skip
        print(fault_table(trials))
        for t in trials:
            if not t.ok:
                print(f"  FAIL {t.kind} rank {t.rank}: {t.summary} [{t.evidence}]")
        return 0 if all(t.ok for t in trials) else 1
    if a.cmd == "healthy":
        out = a.out or Path(tempfile.mkdtemp(prefix="diag-soak-"))
        t0 = time.monotonic()
        r = soak(
            out, a.job_minutes, a.parallel, (a.min_seconds, a.max_seconds), a.seed, a.noise,
            log=lambda s: print(s, flush=True),
        )  # fmt: skip
        print(
            f"\nhealthy soak: {r.jobs} jobs, {r.job_seconds / 60:.1f} min of job time in "
            f"{(time.monotonic() - t0) / 60:.1f} min wall, {len(r.incidents)} incidents, "
            f"{len(r.failed_jobs)} failed jobs; results in {out}"
        )
        for line in r.incidents + r.failed_jobs:
            print("  " + line)
        return 1 if r.incidents or r.failed_jobs else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
