"""Loading a DeepSpeed checkpoint at another data-parallel size, through a universal checkpoint.

ZeRO (and the bf16 optimizer) save one optimizer partition per data-parallel rank, and DeepSpeed
refuses to load them at another data-parallel size. Its universal checkpoint converter
(`python -m deepspeed.checkpoint.ds_to_universal`) merges the partitions into one file per
parameter and state, which `load_checkpoint` with `checkpoint.load_universal` splits again for
the new size. We run both unchanged: global rank 0 converts once, every rank loads.

    <save_dir>/global_step{N}/...                         the checkpoint as saved
    <save_dir>/.diag/universal/global_step{N}/latest_universal, global_step{N}/...
                                                          its conversion (kept until the next one)

A conversion is built in a temporary directory and renamed into place once complete and fsynced,
so a crash never leaves one that looks complete; a complete one is reused by later restarts.
The data-parallel size a step was saved at comes from the names of its optimizer partition files.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.trainer.graceful.teardown import quiesce_at_exit

log = logging.getLogger(__name__)

UNIVERSAL_DIR = Path(".diag", "universal")
LATEST_UNIVERSAL = "latest_universal"  # what DeepSpeed's converter and loader call it
CONVERTER = "deepspeed.checkpoint.ds_to_universal"
_PARTITION_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_TMP_MARK = ".tmp-"
WAIT_TIMEOUT_S = 6 * 3600.0  # how long the other ranks wait for rank 0's conversion


class ReshardError(RuntimeError):
    pass


# -- pure ------------------------------------------------------------------------------------


def saved_dp_size(names: Iterable[str]) -> int | None:
    """The data-parallel size a step directory was saved at, from its file names; None when it
    holds no optimizer partitions (no ZeRO: nothing depends on the size)."""
    ranks = {int(m.group(1)) for n in names if (m := _PARTITION_RE.match(n))}
    return max(ranks) + 1 if ranks else None


@dataclass(frozen=True)
class Verdict:
    """What rank 0 found and did, as every rank needs to know it."""

    saved_dp: int | None
    current_dp: int
    load_dir: str = ""  # where to load from, when resharded
    seconds: float = 0.0  # converting (0 when an earlier conversion was reused)
    source_bytes: int = 0
    reused: bool = False
    error: str = ""

    @property
    def resharded(self) -> bool:
        return self.saved_dp is not None and self.saved_dp != self.current_dp


def needs_reshard(saved_dp: int | None, current_dp: int) -> bool:
    return saved_dp is not None and saved_dp != current_dp


@dataclass(frozen=True)
class LoadResult:
    path: str | None  # what engine.load_checkpoint returned
    client_state: Any
    verdict: Verdict
    saved_batch: int | None = None  # the global batch the checkpoint was trained with


# -- files and the converter -----------------------------------------------------------------


def universal_dir(load_dir: str | os.PathLike[str], tag: str) -> Path:
    """Where the conversion of `tag` lives (a load_dir for DeepSpeed, with `tag` inside)."""
    return Path(load_dir) / UNIVERSAL_DIR / tag


def convert(
    load_dir: str | os.PathLike[str], tag: str, *, workers: int | None = None
) -> tuple[Path, float, int, bool]:
    """Converts `<load_dir>/<tag>` with DeepSpeed's converter (or reuses a complete conversion).
    Returns (load dir of the conversion, seconds, bytes of the source, reused)."""
    src = Path(load_dir) / tag
    dst = universal_dir(load_dir, tag)
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    if (dst / LATEST_UNIVERSAL).is_file():
        return dst, 0.0, size, True
    dst.parent.mkdir(parents=True, exist_ok=True)
    for stale in dst.parent.glob(f".*{_TMP_MARK}*"):  # a converter that died with its rank
        shutil.rmtree(stale, ignore_errors=True)
    tmp = dst.parent / f".{tag}{_TMP_MARK}{os.getpid()}"
    tmp.mkdir()
    n = workers or max(1, min(4, os.cpu_count() or 1))
    cmd = [
        sys.executable, "-m", CONVERTER, "--input_folder", str(src),
        "--output_folder", str(tmp / tag), "--num_extract_workers", str(n),
        "--num_merge_workers", str(max(1, n // 2)),
        # Models that are not Megatron's carry no universal_checkpoint_info; the converter adds
        # the version marker it needs (a no-op when the checkpoint has it).
        "--inject_missing_state",
    ]  # fmt: skip
    log.info("diag: converting %s (%.1f MB) to a universal checkpoint", src, size / 1e6)
    t0 = time.monotonic()
    try:
        _run_converter(cmd)
        _fsync_tree(tmp)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not (dst / LATEST_UNIVERSAL).is_file():
                raise
            return dst, 0.0, size, True  # completed by someone else meanwhile
        _fsync_dir(dst.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - t0
    log.info("diag: converted %s in %.1f s", src, seconds)
    for other in dst.parent.iterdir():  # older conversions are of no further use
        if other != dst and _TMP_MARK not in other.name:
            shutil.rmtree(other, ignore_errors=True)
    return dst, seconds, size, False


def _run_converter(cmd: list[str]) -> None:
    """Runs the converter, passing its progress to the log and keeping its last lines."""
    tail: collections.deque[str] = collections.deque(maxlen=30)
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                log.info("ds_to_universal: %s", line)
        rc = proc.wait()
    if rc != 0:
        raise ReshardError(
            f"DeepSpeed's universal checkpoint converter failed (exit {rc}): {' '.join(cmd)}\n"
            + "\n".join(tail)
        )


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- engines -----------------------------------------------------------------------------------


def engine_dp_size(engine: Any) -> int:
    """The size ZeRO partitions over (data parallel x sequence parallel)."""
    size = getattr(engine, "seq_dp_world_size", None) or getattr(engine, "dp_world_size", None)
    return int(size or 1)


def decide(
    engine: Any, load_dir: str | os.PathLike[str], tag: str, *, workers: int | None = None
) -> Verdict:
    """Rank 0's part: the saved and current sizes, and the conversion when they differ."""
    step_dir = Path(load_dir) / tag
    current = engine_dp_size(engine)
    try:
        saved = saved_dp_size(os.listdir(step_dir))
    except OSError:
        return Verdict(None, current)  # DeepSpeed reports a missing checkpoint in its own words
    if not needs_reshard(saved, current):
        return Verdict(saved, current)
    try:
        path, seconds, size, reused = convert(load_dir, tag, workers=workers)
    except Exception as e:
        return Verdict(saved, current, error=f"{type(e).__name__}: {e}")
    return Verdict(saved, current, str(path), seconds, size, reused)


def load(
    engine: Any,
    load_dir: str | os.PathLike[str],
    tag: str,
    *,
    timeout_s: float = WAIT_TIMEOUT_S,
    workers: int | None = None,
    **load_kwargs: Any,
) -> LoadResult:
    """`engine.load_checkpoint(load_dir, tag)`, through a universal checkpoint when `tag` was
    saved at another data-parallel size. Collective: call it on every rank. The other ranks wait
    for rank 0's conversion on a gloo group of their own whose timeout is `timeout_s` (a big
    checkpoint converts for longer than a default group's 30 minutes), inside the "load" phase,
    so an agent watching them allows for it."""
    from diag.trainer.attach import phase

    quiesce_at_exit()
    with phase("load"):
        return _load(engine, load_dir, tag, timeout_s, workers, load_kwargs)


def _load(
    engine: Any,
    load_dir: str | os.PathLike[str],
    tag: str,
    timeout_s: float,
    workers: int | None,
    load_kwargs: dict[str, Any],
) -> LoadResult:
    import datetime

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        try:
            box: list[Any] = (
                [decide(engine, load_dir, tag, workers=workers)] if dist.get_rank() == 0 else [None]
            )
            dist.broadcast_object_list(box, src=0, group=group)
        finally:
            dist.destroy_process_group(group)
        verdict: Verdict = box[0]
    else:
        verdict = decide(engine, load_dir, tag, workers=workers)
    if verdict.error:
        raise ReshardError(
            f"cannot load {Path(load_dir) / tag} (saved at data-parallel size {verdict.saved_dp}) "
            f"at size {verdict.current_dp}: {verdict.error}"
        )
    if not verdict.resharded:
        with direct():
            path, client_state = engine.load_checkpoint(str(load_dir), tag=tag, **load_kwargs)
        return LoadResult(path, client_state, verdict)
    log.warning(
        "diag: %s was saved at data-parallel size %d, this run has %d: loading its universal "
        "checkpoint%s", Path(load_dir) / tag, verdict.saved_dp, verdict.current_dp,
        " (converted earlier)" if verdict.reused else f" (converted in {verdict.seconds:.1f} s)",
    )  # fmt: skip
    with direct(), universal_loading(engine):
        path, client_state = engine.load_checkpoint(verdict.load_dir, tag=tag, **load_kwargs)
    saved_batch = _saved_batch(client_state)
    if saved_batch is not None and saved_batch != _engine_batch(engine):
        log.warning(
            "diag: the global batch changed from %d to %s with the world size; keep it with an "
            "elastic config (diag.trainer.elastic.batchsize)", saved_batch, _engine_batch(engine),
        )  # fmt: skip
    return LoadResult(path, client_state, verdict, saved_batch)


@contextlib.contextmanager
def universal_loading(engine: Any) -> Iterator[None]:
    """`checkpoint.load_universal` for the length of one load (DeepSpeed reads the setting only
    while loading, so a config need not carry it, and a same-size restart loads as usual)."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def _saved_batch(client_state: Any) -> int | None:
    try:
        return int(client_state["ds_config"]["train_batch_size"])
    except (KeyError, TypeError, ValueError):
        return None


def _engine_batch(engine: Any) -> int | None:
    try:
        return int(engine.train_batch_size())
    except Exception:
        return None


# -- a hook on DeepSpeedEngine.load_checkpoint, for trainers that load by themselves ---------------

_local = threading.local()
_hook_lock = threading.Lock()


@contextlib.contextmanager
def direct() -> Iterator[None]:
    """Loads inside go straight to DeepSpeed (the hook stays out of the way)."""
    before = getattr(_local, "direct", False)
    _local.direct = True
    try:
        yield
    finally:
        _local.direct = before


def install_load_hook() -> None:
    """Makes every `DeepSpeedEngine.load_checkpoint` reshard when the checkpoint's data-parallel
    size differs from the engine's (for trainers that call it themselves, such as the
    HuggingFace Trainer's resume_from_checkpoint). Idempotent."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    quiesce_at_exit()
    with _hook_lock:
        original = DeepSpeedEngine.load_checkpoint
        if getattr(original, "_diag_reshard", False):
            return

        def load_checkpoint(self: Any, load_dir: str, tag: Any = None, **kwargs: Any) -> Any:
            if getattr(_local, "direct", False) or self.load_universal_checkpoint():
                return original(self, load_dir, tag, **kwargs)
            if tag is None:
                try:
                    tag = Path(load_dir, "latest").read_text().strip()
                except OSError:
                    return original(self, load_dir, tag, **kwargs)
            result = load(self, load_dir, str(tag), **kwargs)
            return result.path, result.client_state

        load_checkpoint._diag_reshard = True  # type: ignore[attr-defined]
        load_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
        DeepSpeedEngine.load_checkpoint = load_checkpoint
