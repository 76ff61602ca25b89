"""Training time lost per fault, end to end: one job and one fault schedule through five stacks.

    nice -n 19 .venv/bin/python bench/goodput.py --quick          # a short try (small model)
    nice -n 19 .venv/bin/python bench/goodput.py --svg goodput.svg  # the full run (many minutes)
    python3 bench/goodput.py --device cuda --stacks default,inplace  # on a machine with a GPU

The job (tests/support/jobs/goodput_job.py): DeepSpeed ZeRO-2 on CPU (gloo), 4 ranks as 2 "nodes" on
this machine, each node with its own launcher, run directory and shared memory, meeting in a c10d
rendezvous (tests/support/goodput/goodputkit.py); --hidden 2900 is 34M parameters, 0.54 GB of checkpoint
state (fp32 weights and Adam's two moments); a fixed number of steps. The schedule puts one fault
of each kind at seeded steps and ranks: kill (SIGKILL a rank), hang (a rank sleeps in Python), gil
(a rank spins in C with the GIL held), preempt (node-b's launcher and agent get SIGTERM, SIGKILL
after --grace, then it comes back) and lost (node-b's processes killed, its run directory and
shared memory wiped; it comes back empty). --nproc-per-node sets the ranks per node (2; the
schedule picks its ranks among them all).

--device cuda runs the same job with NCCL on one GPU: one rank per node, both on GPU 0. NCCL
refuses two ranks of one host on one GPU, so each node gets a host id of its own (NCCL_HOSTID)
and the two talk over NCCL's socket transport on the loopback (goodputkit.nccl_env); the
timings are then those of NCCL's collectives, its timeouts and CUDA's start-up, not of a real
network. The torchft and dlrover stacks run on CPU only.

The stacks:

- default: torchrun --max-restarts, `engine.save_checkpoint` every --every steps, collective
  timeouts of 60 s (torch's defaults are 30 min for gloo and 10 min for NCCL), resume from
  `latest`;
- dlrover: dlrover-run with DLRover's flash checkpoint (memory every step, storage every --every);
- diag: `diag agent --on-hang stop` per node (it drains on SIGTERM), `attach`, a flash checkpoint
  in memory every step (the agent writes every --every-th to storage), `graceful_exit`,
  torchrun's restarts; each node's agent holds the other's newest flash checkpoint in memory
  (--replica-nodes; --no-replicas: none), so a lost node's ranks resume from memory too;
- inplace: recovery in place: `diag launch` per node (torchrun's arguments, a warm spare per node),
  the training under `diag.trainer.resilient`, `diag agent --on-hang recover`, the same flash
  checkpoints and replicas as diag; a rank's fault is recovered in the surviving processes (a
  dead or stuck rank replaced by the spare), a node's fault restarts every worker as torchrun
  does;
- torchft: torchft 0.2.0's Manager, one replica group per node (each node's torchrun restarts its
  group), its lighthouse, the same model with the gradient averaged in the group and across the
  groups (tests/support/jobs/torchft_job.py); the healthy group trains on while the failed one
  restarts and heals from it. Its lost time is lost sample throughput, as
  tests/support/goodput/torchfttimes.py says.

Printed per stack: the wall time to finish the steps, goodput (the seconds of the steps kept at the
end, each step's last run from its start to the end of engine.step(), over the wall time), and per
fault the time lost, in parts measured as tests/support/goodput/goodputtimes.py says, the step trained
and the step restored, and where each node's ranks restored from (memory, replica, storage).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
import repo  # noqa: E402  (tests/support: where every helper folder is)

repo.on_sys_path()

from goodputkit import KINDS, NODES, Fault, GoodputJob, JobSpec, read_events, schedule  # noqa: E402
from goodputsvg import draw  # noqa: E402
from goodputtimes import PARTS, RunTimes, analyse  # noqa: E402
from scratch import private_tmpdir  # noqa: E402
from torchftkit import INSTALL as TORCHFT_INSTALL  # noqa: E402
from torchftkit import TorchftJob  # noqa: E402
from torchfttimes import analyse_torchft  # noqa: E402
from torchfttimes import table as torchft_table  # noqa: E402

STACKS = ("default", "diag", "dlrover", "inplace", "torchft")
CPU_ONLY = ("dlrover", "torchft")  # their jobs and harnesses assume gloo on CPU


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short schedule and a small model")
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, help="default: 50 (--quick: 40)")
    p.add_argument("--hidden", type=int, help="default: 2900 (--quick: 256)")
    p.add_argument("--every", type=int, help="storage checkpoint every N steps (default 15; 5)")
    p.add_argument("--grace", type=float, default=30.0, help="preemption's grace period, s")
    p.add_argument(
        "--no-replicas", dest="replicas", action="store_false",
        help="diag: no replicas in the peer node (a lost node resumes from storage)",
    )  # fmt: skip
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: NCCL, one rank per node, every rank on GPU 0",
    )  # fmt: skip
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default 2; cuda: 1)")
    p.add_argument(
        "--agent-arg", dest="agent_args", action="append", default=[],
        help="an option for each node's diag agent (the diag and inplace stacks), as one word: "
        "--agent-arg=--hang-factor=2; repeat for more",
    )  # fmt: skip
    p.add_argument("--svg", type=Path, help="write the picture here")
    p.add_argument("--keep", type=Path, help="keep every run's logs and events under this folder")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per stack at most")
    p.add_argument(
        "--from", dest="runs_from", type=Path,
        help="run nothing: the table and picture of the runs kept in this folder by --keep",
    )  # fmt: skip
    a = p.parse_args(argv)
    a.steps = a.steps or (40 if a.quick else 50)
    a.hidden = a.hidden or (256 if a.quick else 2900)
    a.every = a.every or (5 if a.quick else 15)
    if a.nproc_per_node is None:
        a.nproc_per_node = 1 if a.device == "cuda" else 2
    if a.nproc_per_node < 1:
        p.error("--nproc-per-node: at least 1")
    if a.device == "cuda" and a.nproc_per_node != 1:
        p.error("--device cuda runs one rank per node (both nodes share GPU 0): --nproc-per-node 1")
    a.world = len(NODES) * a.nproc_per_node
    return a


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def run_stack(args: argparse.Namespace, stack: str, root: Path) -> RunTimes | str:
    faults = schedule(args.seed, args.steps, tuple(args.kinds.split(",")), args.world)
    spec = JobSpec(
        stack, args.steps, args.hidden, args.every, nproc=args.nproc_per_node, grace=args.grace,
        timeout=args.timeout, replicas=args.replicas, agent_args=tuple(args.agent_args),
        device=args.device,
    )  # fmt: skip
    if args.device != "cpu" and stack in CPU_ONLY:
        return f"not run: CPU only (--device {args.device})"
    if stack == "dlrover":
        try:
            import dlrover  # noqa: F401
        except ImportError:
            return "not run: dlrover is not installed"
    if stack == "torchft" and importlib.util.find_spec("torchft") is None:
        return f"not run: torchft is not installed ({TORCHFT_INSTALL})"
    # Before the run: a run cut short is read (--from) with its own ranks per node.
    (root / "spec.json").write_text(json.dumps(asdict(spec)))
    job = (TorchftJob if stack == "torchft" else GoodputJob)(spec, faults, root, log)
    try:
        outcome = job.run()
    finally:
        job.close()
    (root / "outcome.json").write_text(
        json.dumps({"t0": outcome.t0, "wall": outcome.wall, "why": outcome.why})
    )
    if not outcome.finished:
        log(f"{stack}: {outcome.why}")
    return kept_run(root, spec.pg_timeout, spec.nproc)


def kept_run(root: Path, pg_timeout: float = 60.0, nproc: int = 2) -> RunTimes | str:
    """The times of a run kept under `root`: its events, its faults, its outcome (with the run's
    own ranks per node and timeout where it kept them)."""
    if (root / "spec.json").exists():
        kept = json.loads((root / "spec.json").read_text())
        pg_timeout, nproc = kept["pg_timeout"], kept["nproc"]
    world = len(NODES) * nproc
    faults = [Fault(**f) for f in json.loads((root / "faults.json").read_text())]
    events = read_events(root)
    if (root / "outcome.json").exists():
        outcome = json.loads((root / "outcome.json").read_text())
    else:  # a run cut short: from its first event to its last
        t0 = min(e["t"] for e in events if e["ev"] in ("begin", "node_up"))
        last = max(e["t"] for e in events)
        done = {e["pid"] for e in events if e["ev"] == "done"}
        outcome = {"t0": t0, "wall": last - t0, "why": "" if len(done) >= world else "cut short"}
    how = partial(analyse_torchft, nproc=nproc) if root.name == "torchft" else analyse
    times = how(
        events, faults, outcome["t0"], outcome["wall"], world, root / "timeline", pg_timeout
    )
    if outcome["why"]:
        return replace(times, unfinished=f"did not finish: {outcome['why']} ({times.wall:.0f} s)")
    return times


def _state_gb(root: Path) -> float:
    ckpt = root / "ckpt"
    # DeepSpeed's tags are global_step<N>; DLRover's are <N>.
    tags = sorted(
        (p for p in ckpt.glob("*") if p.is_dir() and p.name.removeprefix("global_step").isdigit()),
        key=lambda p: int(p.name.removeprefix("global_step")),
    )
    if not tags:
        return 0.0
    return sum(f.stat().st_size for f in tags[-1].rglob("*") if f.is_file()) / 1e9


def _ranks(args: argparse.Namespace) -> str:
    """The ranks and device, where they are not the default's (4 ranks on CPU)."""
    if args.device == "cpu" and args.nproc_per_node == 2:
        return ""
    backend = "NCCL" if args.device == "cuda" else "gloo"
    return f"; {args.world} ranks ({args.nproc_per_node} per node) on {args.device}, {backend}"


def report(args: argparse.Namespace, runs: dict[str, RunTimes | str], gb: dict[str, float]) -> None:
    names = list(runs)
    print()
    print(
        f"{dt.date.today()} {platform.node()}, {os.cpu_count()} cores, "
        + ("" if args.runs_from else f"load {os.getloadavg()[0]:.1f} (1 min, at the end); ")
        + f"{args.steps} steps, --hidden {args.hidden} "
        f"({max(gb.values(), default=0):.2f} GB of state on storage), seed {args.seed}, "
        f"storage every {args.every} steps, grace {args.grace:g} s"
        + ("" if args.replicas else ", diag without replicas")
        + _ranks(args)
    )
    print()
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))

    def row(label: str, fn) -> None:  # type: ignore[no-untyped-def]
        cells = [
            r if isinstance(r, str) else r.unfinished if r.unfinished else fn(r)
            for r in runs.values()
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")

    row("wall time to finish (s)", lambda r: f"{r.wall:.0f}")
    row("goodput (steps kept / wall)", lambda r: f"{r.goodput:.1%}")
    row("steps kept (s)", lambda r: f"{r.kept:.0f}")
    row("first start (s)", lambda r: f"{r.startup:.0f}")
    row("lost to faults (s)", lambda r: f"{sum(x.total for x in r.losses):.0f}")
    row("median step (s)", lambda r: f"{r.step_s:.2f}")
    row(
        "median save (s), saves",
        lambda r: f"{r.save_s:.2f}, {r.saves}" if r.saves else "-",
    )
    print()
    print(
        "| stack | fault (step) | lost (s) | "
        + " | ".join(PARTS)
        + " | trained, restored (from) | ended by |"
    )
    print("|---|---|---|" + "---|" * len(PARTS) + "---|---|")
    for name, r in runs.items():
        if isinstance(r, str):
            continue
        for kind in args.kinds.split(","):
            found = [x for x in r.losses if x.fault.kind == kind]
            if not found:
                print(f"| {name} | {kind} | not fired |" + " |" * (len(PARTS) + 2))
                continue
            x = found[0]
            head = f"| {name} | {kind} ({x.fault.step}) |"
            if x.restored is None:
                print(
                    f"{head} not recovered |" + " - |" * len(PARTS) + f" {x.trained}, - | {x.how} |"
                )
                continue
            parts = " | ".join(f"{x.parts[p]:.1f}" if p in x.parts else "-" for p in PARTS)
            held = f", replica held {x.replica}" if x.replica is not None else ""
            print(
                f"{head} **{x.total:.1f}** | {parts} | {x.trained}, {x.restored} "
                f"({x.source}{held}) | {x.how} |"
            )
    for line in torchft_table(runs, args.kinds.split(",")):
        print(line)
    default = runs.get("default")
    if not isinstance(default, RunTimes) or not default.saves:
        return
    cost = default.save_s / (args.every * default.step_s) if default.step_s else 0.0
    print(
        f"\ndefault: engine.save_checkpoint took {default.save_s:.2f} s (median) every "
        f"{args.every} steps of {default.step_s:.2f} s: {cost:.1%} of step time"
        + ("" if cost <= 0.05 else " (over the 5% aimed at: raise --every)")
    )
    for name, r in runs.items():
        if isinstance(r, RunTimes) and not r.unfinished and name != "default":
            lost = sum(x.total for x in r.losses)
            ref = sum(x.total for x in default.losses)
            if lost:
                print(f"time lost to faults, default / {name}: {ref / lost:.2f}x")
    ratios(args, runs, default)


def ratios(args: argparse.Namespace, runs: dict[str, RunTimes | str], default: RunTimes) -> None:
    """Per fault kind, each stack's time lost over the default stack's (and over diag's)."""
    others = [n for n, r in runs.items() if n != "default" and isinstance(r, RunTimes)]
    if not others:
        return

    def lost(r: RunTimes | str | None, kind: str) -> float | None:
        if not isinstance(r, RunTimes):
            return None
        found = [x for x in r.losses if x.fault.kind == kind and x.restored is not None]
        return found[0].total if found else None

    refs = [("default", default), *[(n, runs[n]) for n in ("diag",) if n in others]]
    cols = [(n, ref) for n in others for ref, _ in refs if ref != n]
    print("\n| fault | " + " | ".join(f"{n} / {ref}" for n, ref in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for kind in args.kinds.split(","):
        cells = []
        for n, ref in cols:
            a, b = lost(runs[n], kind), lost(runs[ref], kind)
            cells.append(f"{a:.1f} / {b:.1f} = {a / b:.2f}" if a is not None and b else "-")
        print(f"| {kind} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stacks = [s for s in args.stacks.split(",") if s]
    faults = schedule(args.seed, args.steps, tuple(args.kinds.split(",")), args.world)
    log("schedule: " + ", ".join(f"{f.kind}@{f.step}" + (f"/r{f.rank}" if f.rank >= 0 else "/node-b")
                                 for f in faults))  # fmt: skip
    top = args.runs_from or args.keep or Path(tempfile.mkdtemp(prefix="diag-goodput-"))
    runs: dict[str, RunTimes | str] = {}
    gb: dict[str, float] = {}
    if args.runs_from:
        for stack in stacks:
            root = top / stack
            found = (root / "faults.json").exists()
            runs[stack] = kept_run(root, nproc=args.nproc_per_node) if found else "not run"
            gb[stack] = _state_gb(root)
        stacks = []
    try:
        for stack in stacks:
            root = top / stack
            root.mkdir(parents=True, exist_ok=True)
            log(f"{stack}: starting")
            runs[stack] = run_stack(args, stack, root)
            gb[stack] = _state_gb(root)
            r = runs[stack]
            done = r if isinstance(r, str) else r.unfinished or f"{r.wall:.0f} s, {r.goodput:.1%}"
            log(f"{stack}: {done}")
            if stack != stacks[-1]:
                report(args, runs, gb)  # so far: a long run shows what it has
    finally:
        if not args.keep and not args.runs_from:
            shutil.rmtree(top, ignore_errors=True)
    report(args, runs, gb)
    if args.svg:
        title = f"goodput bench, seed {args.seed}, {args.steps} steps, {dt.date.today()}"
        args.svg.write_text(draw(runs, args.steps, title))
        print(f"\npicture: {args.svg}")
    return 0 if all(isinstance(r, RunTimes) and not r.unfinished for r in runs.values()) else 1


if __name__ == "__main__":
    with private_tmpdir():
        rc = main()
    sys.exit(rc)
