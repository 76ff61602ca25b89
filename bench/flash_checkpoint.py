"""Flash checkpoint against DeepSpeed's own save, side by side in one run.

    .venv/bin/python bench/flash_checkpoint.py                 # 2 CPU ranks, ~1.1 GB of state
    .venv/bin/python bench/flash_checkpoint.py --gpu           # CUDA ranks (one per GPU, max 2)

Measures, on the same DeepSpeed ZeRO-2 job (fp32 Adam; --params-m million parameters):
- the blocking time of `FlashCheckpointer.save(step)` (steady state, and the first save, which
  allocates the shared memory), against
- a plain memory copy of the same bytes: the same storages copied into a pre-faulted buffer, and
  one contiguous copy of the same byte count (the physical bound), and
- `engine.save_checkpoint` to local disk (torch.save into the page cache, as users run it);
- the agent's persist throughput (its worker threads, fsync included) against a sequential write
  of the same bytes (one thread per rank, os.write in 64 MiB chunks, fsync).
Times are the slowest rank's, median of --repeats. Prints a table with ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scratch import private_tmpdir

JOB = "bench-flash"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params-m", type=float, default=68.0, help="million parameters")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, help="write the measurements here too")
    p.add_argument(
        "--dlrover",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also DLRover's flash checkpoint on the same engine (default: with --gpu)",
    )
    p.add_argument(
        "--first-save",
        action="store_true",
        help="only the first save of a launch: diag fresh and relaunched against DLRover's, "
        "over --repeats + 1 launches (bench/flash_first_save.py)",
    )
    p.add_argument("--launch", type=int, help=argparse.SUPPRESS)  # first-save launch, rank side
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # results dir, torchrun side
    p.add_argument("--dlrover-saver", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the ranks -----------------------------------------------------------------------------------


def build_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The bench's DeepSpeed ZeRO-2 engine (process group up), after two steps: Adam's state
    exists after the first. Returns (engine, model, hidden size, layers)."""
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if args.gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.gpu else "gloo")
    h = 2048
    layers = max(1, round(args.params_m * 1e6 / (h * h + h)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(h, h) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    for _ in range(2):
        x = torch.randn(2, h, device=engine.device)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return engine, model, h, layers


def timers(args: argparse.Namespace, engine):  # type: ignore[no-untyped-def]
    """(slowest, timed): a rank's seconds made the slowest rank's, and a function timed from a
    barrier on every rank (the slowest rank's time)."""
    import torch
    import torch.distributed as dist

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=engine.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if args.gpu:
            torch.cuda.synchronize()
        return slowest(time.perf_counter() - t0)

    return slowest, timed


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import diag.trainer

    engine, model, h, layers = build_engine(args)
    if args.launch is not None:
        import flash_first_save

        return flash_first_save.launch(args, engine, *timers(args, engine))
    rank, world = dist.get_rank(), dist.get_world_size()
    slowest, timed = timers(args, engine)
    out = args.worker
    disk = Path(args.disk_dir) / "bench-flash-deepspeed"
    ckpt = diag.trainer.FlashCheckpointer(engine, out / "persisted", job=JOB, control=False)

    def save_and_copy(step: int) -> None:
        ckpt.save(step)
        ckpt.wait()

    first = timed(lambda: save_and_copy(1))
    first_rest = timed(ckpt.wait_slots)  # the other slot, mapped in the background after it
    flash, background, sync = [], [], []
    for s in range(2, 2 + args.repeats):
        flash.append(timed(lambda s=s: ckpt.save(s)))  # returns once the state is captured
        background.append(timed(ckpt.wait))  # the copy, finishing alone
    ckpt.async_copy = False
    for s in range(10, 10 + args.repeats):
        sync.append(timed(lambda s=s: ckpt.save(s)))
    copy_s = slowest(ckpt.stats.last_copy_seconds)

    def train(steps: int, save: str) -> None:
        for i in range(steps):
            x = torch.randn(2, h, device=engine.device)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            if save:
                ckpt.async_copy = save == "async"
                ckpt.save(100 + i)
        ckpt.wait()

    modes = ["", "async", "sync"]
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.repeats):  # interleaved, rotating the order: other load is shared fairly
        for m in modes[i % 3 :] + modes[: i % 3]:
            runs[m].append(timed(lambda m=m: train(2, m)) / 2)
    step_time = {m: statistics.median(v) for m, v in runs.items()}

    same, contiguous = memcpy_baselines(engine, out, timed, args.gpu, args.repeats)

    def ds_save(i: int) -> None:
        engine.save_checkpoint(str(disk), tag=f"ds{i}")

    deepspeed_s = []
    for i in range(args.repeats):
        deepspeed_s.append(timed(lambda i=i: ds_save(i)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(disk / f"ds{i}", ignore_errors=True)
    dlrover = dlrover_flash(engine, out, timed, args.repeats) if args.dlrover else None
    sizes = [None] * world
    dist.all_gather_object(sizes, (ckpt.stats.last_save_bytes, ckpt.stats.last_save_bytes))
    if rank == 0:
        shutil.rmtree(disk, ignore_errors=True)
        (out / "ranks.json").write_text(
            json.dumps(
                {
                    "world": world,
                    "layers": layers,
                    "params": sum(p.numel() for p in model.parameters()),
                    "state_bytes": sum(s[1] for s in sizes),
                    "copied_bytes_per_rank": [s[0] for s in sizes],
                    "first_save": first,
                    "first_save_rest": first_rest,
                    "flash": flash,
                    "flash_background_copy": background,
                    "flash_sync": sync,
                    "flash_copy_part": copy_s,
                    "step_time": step_time,
                    "memcpy_same_tensors": same,
                    "memcpy_contiguous": contiguous,
                    "deepspeed_save": deepspeed_s,
                    "dlrover": dlrover,
                    "device": "cuda" if args.gpu else "cpu",
                }
            )
        )
    ckpt.close(remove=False)  # the driver persists these snapshots with the agent's code
    dist.destroy_process_group()
    return 0


def dlrover_flash(engine, out: Path, timed, repeats: int) -> dict:  # type: ignore[no-untyped-def]
    """DLRover's flash checkpoint (DeepSpeedCheckpointer, save to memory) on the same engine and
    state. Never fails the bench: a rank that cannot run it says why, and if any rank cannot, no
    rank measures it (the ranks agree first, so no one waits in a barrier alone)."""
    import torch
    import torch.distributed as dist

    def agree(ok: bool) -> bool:
        t = torch.tensor([0 if ok else 1], device=engine.device)
        dist.all_reduce(t)
        return int(t.item()) == 0

    error, ck = "", None
    try:
        from dlrover.trainer.torch.flash_checkpoint import deepspeed as dl_ds
        from dlrover.trainer.torch.flash_checkpoint import engine as dl_engine
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

        _accept_extra_kwargs(dl_ds.AsyncCheckpointAgent)
        _bound_setup_wait(dl_engine)
        # The driver hosts DLRover's saver, as dlrover-run's agent does for its workers, which
        # it marks with this role so that they do not fork a saver of their own.
        os.environ["ROLE_NAME"] = "dlrover-trainer"
        ck = dl_ds.DeepSpeedCheckpointer(engine, str(out / "dlrover"))
    except Exception as e:  # not installed, no saver, or this DLRover and DeepSpeed disagree
        error = f"{type(e).__name__}: {e}"
    if not agree(not error):
        return {"error": error or "another rank could not start it"}

    def save(tag: str) -> None:
        ck.save_checkpoint(str(out / "dlrover"), tag, storage_type=StorageType.MEMORY)

    got: dict = {}
    try:
        got["first_save"] = timed(lambda: save("dl0"))
        got["memory_save"] = [timed(lambda i=i: save(f"dl{i}")) for i in range(1, 1 + repeats)]
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if not agree(not error):
        return {"error": error or "another rank failed"}
    with contextlib.suppress(Exception):
        ck._async_save_engine.close()
    return got


def _accept_extra_kwargs(agent_cls) -> None:  # type: ignore[no-untyped-def]
    """DLRover 0.6.1's agent stands in for torch.save/torch.load, to which DeepSpeed 0.19
    passes keyword arguments it does not take."""
    if getattr(agent_cls, "_bench_patched", False):
        return
    save, load = agent_cls.save, agent_cls.load
    agent_cls.save = lambda self, sd, path, *a, **kw: save(self, sd, path)
    agent_cls.load = lambda self, path, map_location=None, *a, **kw: load(self, path, map_location)
    agent_cls._bench_patched = True


SETUP_WAIT_S = 15.0


def _bound_setup_wait(engine_module) -> None:  # type: ignore[no-untyped-def]
    """DLRover waits 60 s for each of its saver's sockets; a saver that is not there should
    cost the bench seconds."""
    wait = engine_module.wait_socket_server
    if getattr(wait, "_bench_bounded", False):
        return

    def bounded(server, timeout=SETUP_WAIT_S):  # type: ignore[no-untyped-def]
        return wait(server, timeout=min(timeout, SETUP_WAIT_S))

    bounded._bench_bounded = True  # type: ignore[attr-defined]
    engine_module.wait_socket_server = bounded


def dlrover_saver() -> int:
    """DLRover's checkpoint saver, hosted the way dlrover-run's elastic agent hosts it: a process
    of its own (not forked from a rank) that serves the ranks' sockets and shared memory, named
    after TORCHELASTIC_RUN_ID. It lives until the driver ends it."""
    from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

    AsyncCheckpointSaver.start_async_saving_ckpt()
    parent = os.getppid()
    while os.getppid() == parent:  # the driver gone (killed itself): nothing left to serve
        time.sleep(0.5)
    return 0


def start_dlrover_saver(run_id: str, env: dict[str, str]) -> subprocess.Popen | None:
    try:
        import dlrover  # noqa: F401
    except ImportError:
        return None  # the ranks say so in the table
    return subprocess.Popen(
        [sys.executable, __file__, "--dlrover-saver"], env=dict(env, TORCHELASTIC_RUN_ID=run_id)
    )


def dlrover_cleanup(run_id: str, saver: subprocess.Popen | None) -> None:
    """What DLRover leaves: its saver process, its shared memory and its sockets, all named
    after the torchrun run id we gave."""
    if saver is not None:
        saver.kill()
        saver.wait()
    for p in Path("/dev/shm").glob(f"{run_id}_*"):
        with contextlib.suppress(OSError):
            p.unlink()
    try:
        from dlrover.python.common.multi_process import SOCKET_TMP_DIR
    except ImportError:
        return
    shutil.rmtree(Path(SOCKET_TMP_DIR, run_id), ignore_errors=True)
    with contextlib.suppress(OSError):  # only when no other job's sockets are left in it
        os.rmdir(SOCKET_TMP_DIR)


def memcpy_baselines(engine, out: Path, timed, pin: bool, repeats: int):  # type: ignore[no-untyped-def]
    """The same bytes, copied by the same primitive into ordinary (pre-faulted) memory: the
    storages a save captures, one by one; and one contiguous buffer of the same size."""
    import torch

    from diag.trainer.flash.capture import capture_checkpoint

    files = capture_checkpoint(engine, str(out / "capture"), "global_step0", {})
    storages = [s for f in files for s in f.storages]
    nbytes = sum(s.nbytes for s in storages)
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    buf.fill_(0)
    src = torch.empty(nbytes, dtype=torch.uint8, device=engine.device)
    src.fill_(1)

    def copy_same_tensors() -> None:
        off = 0
        for s in storages:
            t = torch.empty(0, dtype=torch.uint8, device=s.storage.device)
            t.set_(s.storage, 0, (s.nbytes,), (1,))
            buf[off : off + s.nbytes].copy_(t, non_blocking=pin)
            off += s.nbytes

    same = [timed(copy_same_tensors) for _ in range(repeats)]
    contiguous = [timed(lambda: buf.copy_(src, non_blocking=pin)) for _ in range(repeats)]
    return same, contiguous


# -- the driver ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def persist_with_agent(run_dir: Path, save_dir: Path) -> tuple[float, int]:
    """The agent's request path: every rank's newest snapshot, its worker threads, fsync."""
    from diag.agent.checkpoint.manager import CheckpointManager, CheckpointSettings
    from diag.formats.slotfile import read_snapshots
    from diag.formats.snapshot import find_slots

    snaps = read_snapshots(find_slots(run_dir, JOB))
    newest = max(s.meta.step for s in snaps)
    ranks = sorted({s.meta.rank for s in snaps if s.meta.step == newest})
    manager = CheckpointManager(run_dir, JOB, CheckpointSettings(save_dir=save_dir, keep_last=1))
    t0 = time.perf_counter()
    for r in ranks:
        manager.request_persist(JOB, r, newest, str(save_dir))
    while len(manager.results) < len(ranks):
        time.sleep(0.005)
    seconds = time.perf_counter() - t0
    manager.close()
    bad = [r for r in manager.results if not r.ok]
    if bad:
        raise RuntimeError(f"persist failed: {bad}")
    return seconds, sum(r.nbytes for r in manager.results)


def sequential_write(run_dir: Path, target: Path, per_rank: list[int]) -> float:
    """The same byte counts from shared memory to files, one thread per rank, then fsync."""
    from diag.formats.slotfile import SlotFile
    from diag.formats.snapshot import HEADER_SIZE, find_slots

    target.mkdir(parents=True, exist_ok=True)
    slots = [SlotFile.open(p) for p in find_slots(run_dir, JOB)]
    sources = {s.header().rank: s for s in slots}

    def write(rank: int, n: int) -> None:
        view = sources[rank].view(HEADER_SIZE, min(n, sources[rank].capacity - HEADER_SIZE))
        fd = os.open(target / f"rank{rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = n
            while left:
                chunk = view[: min(left, 64 << 20, len(view))]
                left -= os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
            del view

    threads = [threading.Thread(target=write, args=(r, n)) for r, n in enumerate(per_rank)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    for s in slots:
        s.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker is not None:
        # A ZeRO rank leaves without finalizing the interpreter (gloo teardown race).
        from diag.trainer import exit_process

        exit_process(worker(args))
    if args.dlrover_saver:
        return dlrover_saver()
    if args.first_save:
        import flash_first_save

        return flash_first_save.drive(args)
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("--gpu: no CUDA device here", file=sys.stderr)
            return 2
        args.nproc = min(args.nproc, torch.cuda.device_count())
    if args.dlrover is None:
        args.dlrover = args.gpu
    run_id = f"bench-flash-{os.getpid()}"
    r: dict = {}
    saver = None
    work = Path(tempfile.mkdtemp(prefix="bench-flash-", dir=args.disk_dir))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-flash-run-", dir="/dev/shm"))
    try:
        env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_CONTROL="0")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.nproc)))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
            str(args.nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "--rdzv-id", run_id, __file__, "--worker", str(work), "--params-m", str(args.params_m), "--repeats",
            str(args.repeats), "--disk-dir", str(args.disk_dir), *(["--gpu"] if args.gpu else []),
            "--dlrover" if args.dlrover else "--no-dlrover",
        ]  # fmt: skip
        if args.dlrover:
            saver = start_dlrover_saver(run_id, env)
        subprocess.run(cmd, env=env, check=True)
        r = json.loads((work / "ranks.json").read_text())
        per_rank = r["copied_bytes_per_rank"]
        persist, sequential = [], []
        for i in range(args.repeats):
            # Alternating which goes first; each starts with no writeback pending.
            for what in ("persist", "sequential")[:: 1 if i % 2 == 0 else -1]:
                os.sync()
                if what == "persist":
                    s, persisted = persist_with_agent(run_dir, work / f"persisted{i}")
                    persist.append(s)
                else:
                    sequential.append(sequential_write(run_dir, work / f"sequential{i}", per_rank))
            shutil.rmtree(work / f"persisted{i}", ignore_errors=True)
            shutil.rmtree(work / f"sequential{i}", ignore_errors=True)
        med = statistics.median
        report(args, r, med(persist), persisted, med(sequential), sum(per_rank))
        if args.json is not None:
            name = ""
            if args.gpu:
                import torch

                name = torch.cuda.get_device_name(0)
            doc = dict(r, device_name=name, persist=persist, persisted_bytes=persisted,
                       sequential_write=sequential, sequential_bytes=sum(per_rank))  # fmt: skip
            args.json.write_text(json.dumps(doc, indent=1))
    finally:
        if args.dlrover:
            dlrover_cleanup(run_id, saver)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _dlrover_rows(dl: dict | None, ds: float, total: int) -> list[tuple[str, float, int, str]]:
    if not dl or "error" in dl:
        return []
    mem = statistics.median(dl["memory_save"])
    return [
        ("DLRover flash save to memory, blocking", mem, total, f"{ds / mem:.1f}x below DS save"),
        ("DLRover flash save, first", dl["first_save"], total, "once per job"),
    ]


def report(
    args: argparse.Namespace,
    r: dict,
    persist_s: float,
    persisted: int,
    seq_s: float,
    seq_bytes: int,
) -> None:
    med = statistics.median
    flash, sync = med(r["flash"]), med(r["flash_sync"])
    same, contiguous = med(r["memcpy_same_tensors"]), med(r["memcpy_contiguous"])
    ds = med(r["deepspeed_save"])
    total = r["state_bytes"]
    gb = 1e9
    print(
        f"\nflash checkpoint bench, {dt.date.today()}, {platform.node()}, "
        f"{os.cpu_count()} cores, {r['device']}, {r['world']} ranks, ZeRO-2 fp32 Adam, "
        f"{r['params'] / 1e6:.0f} M parameters, {total / gb:.2f} GB of checkpoint state "
        f"(largest rank copies {max(r['copied_bytes_per_rank']) / gb:.2f} GB); "
        f"median of {args.repeats}, slowest rank\n"
    )
    rows = [
        ("save(step), blocking (async copy)", flash, total, f"{ds / flash:.1f}x below DS save"),
        ("  its copy, finishing in the background", med(r["flash_background_copy"]), total, ""),
        ("save(step), blocking (copy inline)", sync, total, f"{sync / contiguous:.2f}x memcpy"),
        ("save(step), first (allocates its slot)", r["first_save"], total, "once per launch"),
        ("  the other slot, in the background after", r["first_save_rest"], total, "not blocking"),
        ("memcpy, same tensors (torch copy_)", same, total, ""),
        ("memcpy, one contiguous buffer", contiguous, total, "physical bound"),
        ("engine.save_checkpoint, local disk", ds, total, "page cache, no fsync"),
        *_dlrover_rows(r.get("dlrover"), ds, total),
        ("agent persist (fsync)", persist_s, persisted, ""),
        ("sequential write (fsync)", seq_s, seq_bytes, "same bytes, 1 thread/rank"),
    ]
    print(f"| {'what':<40} | {'seconds':>8} | {'GB':>5} | {'GB/s':>6} | notes |")
    print(f"|{'-' * 42}|{'-' * 10}|{'-' * 7}|{'-' * 8}|-------|")
    for name, s, n, note in rows:
        print(f"| {name:<40} | {s:8.3f} | {n / gb:5.2f} | {n / gb / s:6.2f} | {note} |")
    dl = r.get("dlrover")
    if dl is not None and "error" in dl:
        print(f"\nDLRover's flash checkpoint: not measured: {dl['error']}")
    st = r["step_time"]
    print(
        f"\ntraining step time: {st[''] * 1e3:.0f} ms without saving, {st['async'] * 1e3:.0f} ms "
        f"saving every step (async copy), {st['sync'] * 1e3:.0f} ms (copy inline)"
    )
    ratio_persist = (persisted / persist_s) / (seq_bytes / seq_s)
    print(
        f"blocking save / contiguous memcpy: async {flash / contiguous:.2f}, inline "
        f"{sync / contiguous:.2f} (target <= 1.5); engine.save_checkpoint / blocking save: "
        f"async {ds / flash:.1f}, inline {ds / sync:.1f} (target >= 10); "
        f"persist throughput / sequential write = {ratio_persist:.2f}"
    )


if __name__ == "__main__":
    with private_tmpdir():
        rc = main()
    sys.exit(rc)
