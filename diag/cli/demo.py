"""`diag demo`: the embedded default. A local multi-rank CPU DeepSpeed job under torchrun, a real
`diag agent` process watching it, an injected fault, and at the end the verdict, the incident
directory and the merged stacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from diag.agent.detect.observation import OpView
from diag.agent.detect.straggler import StragglerScore, straggler_scores
from diag.agent.observe.procs import stop_tree
from diag.cli.demosettings import DemoSettings
from diag.formats import exitcodes
from diag.formats.incidentdir import VERDICT_FILE
from diag.formats.journal import JournalFormatError
from diag.formats.journalmeta import JOURNAL_SUFFIX, read_meta
from diag.formats.journalreader import JournalReader
from diag.formats.records import OpState, RecordKind
from diag.trainer.demo_job import FAULTS
from diag.viewer.merge import MergeResult
from diag.viewer.tree import View

JOB = "demo"


@dataclass
class DemoResult:
    workdir: Path
    agent_rc: int | None
    job_rc: int | None
    incidents: list[Path] = field(default_factory=list)
    verdicts: list[dict] = field(default_factory=list)
    stragglers: list[StragglerScore] = field(default_factory=list)
    merged: MergeResult | None = None
    wall_s: float = 0.0

    @property
    def verdict(self) -> dict | None:
        return self.verdicts[0] if self.verdicts else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(run_dir: Path) -> str:
    parts = []
    for path in sorted(run_dir.glob(f"*{JOURNAL_SUFFIX}")):
        try:
            r = JournalReader(path)
        except JournalFormatError:
            continue
        try:
            parts.append(f"r{r.header.rank}={r.state().step}")
        finally:
            r.close()
    return " ".join(parts) or "starting"


def run_demo(opts: DemoSettings, out=sys.stdout, stop: threading.Event | None = None) -> DemoResult:
    """Runs the job and the agent until the job ends, `opts.timeout` passes or `stop` is set."""
    if opts.fault not in FAULTS:
        raise exitcodes.UsageError(f"--fault must be one of {', '.join(FAULTS)}")
    if not 2 <= opts.nproc <= 64:
        raise exitcodes.UsageError("--nproc must be between 2 and 64")
    if not 0 <= opts.fault_rank < opts.nproc:
        raise exitcodes.UsageError(f"--fault-rank must be in 0..{opts.nproc - 1}")
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="diag-demo-"))
    run_dir, timeline = workdir / "run", workdir / "timeline"
    for d in (run_dir, timeline):
        d.mkdir(parents=True, exist_ok=True)
    # torchrun leaves a torchelastic_* directory in the temp dir per run: keep it in the workdir.
    (workdir / "tmp").mkdir(exist_ok=True)
    env = dict(
        os.environ,
        DIAG_RUN_DIR=str(run_dir),
        DIAG_JOB=JOB,
        OMP_NUM_THREADS="1",
        TMPDIR=str(workdir / "tmp"),
    )
    env.pop("DIAG_TIMELINE", None)
    py = sys.executable
    agent_cmd = [
        py, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir), "--timeline",
        str(timeline), "--job", JOB, "--hang-timeout", str(opts.hang_timeout), "--hang-floor",
        str(opts.hang_floor), "--warmup-timeout", str(max(opts.hang_timeout, 60.0)),
        "--on-hang", opts.on_hang, "--until", "job-end", "--interval", "0.25", "--stop-grace",
        "5", "-v", *opts.agent_args,
    ]  # fmt: skip
    if opts.metrics_port is not None:
        agent_cmd += ["--metrics-port", str(opts.metrics_port)]
    launcher = list(opts.launcher) or [
        py, "-m", "torch.distributed.run", "--nproc-per-node", str(opts.nproc), "--master-addr",
        "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0", "-m",
    ]  # fmt: skip
    job_cmd = [
        *launcher, "diag.trainer.demo_job", "--steps", str(opts.steps), "--zero",
        str(opts.zero), "--fault", opts.fault, "--fault-rank", str(opts.fault_rank), "--fault-step", str(opts.fault_step),
        "--straggle", str(opts.straggle), *opts.job_args,
    ]  # fmt: skip
    if opts.flash_every:
        job_cmd += ["--flash-every", str(opts.flash_every), "--save-dir", str(workdir / "ckpt")]
    print(
        f"diag demo: {opts.nproc} ranks, ZeRO-{opts.zero}, fault {opts.fault!r} on rank "
        f"{opts.fault_rank} at step {opts.fault_step}; workdir {workdir}",
        file=out,
        flush=True,
    )
    t0 = time.monotonic()
    agent_log = open(workdir / "agent.log", "wb")  # noqa: SIM115 - closed below
    job_log = open(workdir / "job.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        agent_cmd, env=env, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True
    )
    job = subprocess.Popen(
        job_cmd, env=env, stdout=job_log, stderr=subprocess.STDOUT, start_new_session=True
    )
    result = DemoResult(workdir=workdir, agent_rc=None, job_rc=None)
    try:
        deadline = t0 + opts.timeout
        last_print = 0.0
        while time.monotonic() < deadline and (job.poll() is None or agent.poll() is None):
            if stop is not None and stop.is_set():
                print("diag demo: stopped by the caller", file=out, flush=True)
                break
            if job.poll() is not None and agent.poll() is None:
                # The job is over; give the agent a moment to notice, then stop it.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(timeout=10)
                break
            if time.monotonic() - last_print >= 2.0:
                last_print = time.monotonic()
                print(
                    f"  {last_print - t0:5.1f}s  steps {_progress(run_dir)}", file=out, flush=True
                )
            time.sleep(0.2)
        else:
            if job.poll() is None or agent.poll() is None:
                print(f"diag demo: timed out after {opts.timeout:g} s", file=out, flush=True)
    finally:
        for proc in (job, agent):
            if proc.poll() is None:
                stop_tree(proc.pid, grace=10)
            proc.wait(timeout=10)
        agent_log.close()
        job_log.close()
    result.agent_rc, result.job_rc = agent.returncode, job.returncode
    result.wall_s = time.monotonic() - t0
    for d in sorted(timeline.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and (d / VERDICT_FILE).exists():
            result.incidents.append(d)
            result.verdicts.append(json.loads((d / VERDICT_FILE).read_text()))
    result.stragglers = journal_stragglers(run_dir)
    if opts.merge and result.incidents:
        result.merged = _merge(result.incidents[0], out)
    return result


def journal_stragglers(run_dir: Path) -> list[StragglerScore]:
    """Straggler scores from whatever the journals still hold after the job."""
    recent: dict[int, tuple[OpView, ...]] = {}
    for path in run_dir.glob(f"*{JOURNAL_SUFFIX}"):
        try:
            reader, meta = JournalReader(path), read_meta(path)
        except (JournalFormatError, OSError, ValueError):
            continue
        names = {g.index: g.name for g in meta.groups}
        ops = []
        for rec in reader.tail(reader.header.capacity):
            if rec.kind == RecordKind.OP and rec.state == OpState.COMPLETED and rec.step >= 2:
                ops.append(
                    OpView(
                        names.get(rec.group, str(rec.group)),
                        rec.group_seq,
                        rec.op,
                        rec.state,
                        rec.nbytes,
                        rec.t_enqueue_ns * 1e-9,
                        rec.t_end_ns * 1e-9,
                        rec.peer,
                    )
                )
        recent[meta.rank] = tuple(ops)
        reader.close()
    return straggler_scores(recent)


def _merge(incident: Path, out) -> MergeResult | None:
    try:
        from diag.viewer.merge import merge_incident
    except ImportError:
        return None
    try:
        return merge_incident(incident)
    except Exception as e:  # the verdict stands even if the picture fails
        print(f"diag demo: merging stacks failed: {e}", file=out)
        return None


def _job_rc_meaning(opts: DemoSettings, result: DemoResult) -> str:
    """Why the job's exit code is what it is: after a fault, torchrun's 1 is the expected end."""
    if not result.job_rc or not result.incidents:
        return ""
    if opts.fault == "exit":
        return f" (expected: rank {opts.fault_rank} was killed, so torchrun failed the job)"
    if opts.on_hang == "stop":
        return " (expected: the agent stopped the ranks, so torchrun failed the job)"
    return ""


def report(opts: DemoSettings, result: DemoResult, out=sys.stdout) -> int:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("")
    handled = result.agent_rc == exitcodes.HANG_DETECTED
    p(
        f"job exit code {result.job_rc}{_job_rc_meaning(opts, result)}, "
        f"agent exit code {result.agent_rc}{' (an incident detected and handled)' if handled else ''}"
        f", {result.wall_s:.1f} s wall"
    )
    top = [s for s in result.stragglers if s.is_straggler]
    shown = result.stragglers[:3] if opts.fault == "straggler" else top
    for s in shown:
        flag = "STRAGGLER" if s.is_straggler else "ok"
        p(
            f"  rank {s.rank}: others wait {s.wait_caused * 1000:.0f} ms for it per collective, "
            f"{s.score:.0%} of the wall time, {s.wait_share:.0%} of all waiting; last to arrive "
            f"in {s.late_share:.0%} of {s.ops} collectives [{flag}]"
        )
    if opts.fault == "straggler":
        if result.incidents:
            p(
                f"FAIL: a straggler is not a hang, but {len(result.incidents)} incident(s) were "
                f"raised: {result.verdict['summary'] if result.verdict else ''}"
            )
            return exitcodes.DEMO_MISMATCH
        named = top[0].rank if top else None
        p(f"no incident (correct: the straggler progresses); straggler named: rank {named}")
        return exitcodes.OK if named == opts.fault_rank else exitcodes.DEMO_MISMATCH
    if not result.incidents:
        p("FAIL: no incident was detected; see agent.log and job.log in " + str(result.workdir))
        return exitcodes.DEMO_MISMATCH if opts.fault != "none" else exitcodes.OK
    v = result.verdict or {}
    p(f"verdict: {v.get('summary')}")
    for s in v.get("suspects", [])[:4]:
        p(f"  suspect rank {s['rank']} ({s['kind']}, score {s['score']:.1f}): {s['reason']}")
    expired = v.get("limit_expired_s_before_verdict")
    if expired is not None:
        p(
            f"verdict {expired:.2f} s after the limit ran out; stacks took "
            f"{v.get('evidence', {}).get('stack_seconds', float('nan')):.2f} s"
        )
    p(f"incident: {result.incidents[0]}")
    if opts.flash_every:
        _report_flash(result.workdir / "ckpt", p)
    merged = result.merged
    if merged is not None:
        classes = merged.classes.get(View.PY, ())
        p(f"merged stacks: {len(classes)} classes of identical Python stacks")
        for c in classes:
            flag = "  SUSPECT" if c.suspect else ""
            p(f"  {c.size} rank(s) [{c.ranks}] at {c.leaf}{flag}")
        p(f"  open in a browser: {merged.py_svg}")
        p(f"  native stacks:     {merged.cpp_svg}")
        p(f"  summary:           {merged.summary_txt}")
    ok = opts.fault == "none" or v.get("culprit") == opts.fault_rank
    p(
        "culprit matches the injected rank"
        if ok
        else f"FAIL: culprit {v.get('culprit')} is not the injected rank {opts.fault_rank}"
    )
    return exitcodes.OK if ok else exitcodes.DEMO_MISMATCH


def _report_flash(save_dir: Path, p) -> None:
    from diag.formats.snapshot import read_latest_step

    step = read_latest_step(save_dir)
    if step is None:
        p(f"flash checkpoint: nothing persisted in {save_dir}")
    else:
        p(f"flash checkpoint: step {step} persisted by the agent in {save_dir} (DeepSpeed layout)")


def main(opts: DemoSettings) -> int:
    """`diag demo`: runs the demo and reports; its exit code."""
    if shutil.which("py-spy") is None and not Path(sys.executable).with_name("py-spy").exists():
        raise exitcodes.UsageError("py-spy is not installed; run ./scripts/bootstrap.sh")
    return report(opts, run_demo(opts))
