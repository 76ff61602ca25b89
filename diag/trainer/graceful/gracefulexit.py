"""`graceful_exit(engine, save_dir)`: a DeepSpeed job saves and leaves when told to go, with or
without a diag agent.

    engine, *_ = deepspeed.initialize(...)
    ckpt = diag.trainer.FlashCheckpointer(engine, "/ckpt/run1")        # optional
    diag.trainer.graceful_exit(engine, "/ckpt/run1", checkpointer=ckpt)
    engine.load_checkpoint("/ckpt/run1")                                 # resume, if any
    for batch in loader:
        loss = engine(batch); engine.backward(loss); engine.step()

SIGTERM, SIGINT, SIGUSR1, SIGUSR2 or the stop file set this rank's stop flag; at the next
agreement (diag.trainer.control.period: at most `max_latency_s` later, unless a single step is longer)
every rank learns of it, all of them save the same step, and leave with DRAIN_EXIT_CODE from
inside `engine.step()`. The save goes through the flash checkpointer when every rank has an agent
to persist it, else straight to storage with `engine.save_checkpoint` (the `latest` file is
written only once every rank's files are on storage). Collective: create it on every rank.

A rank that cannot drain (a peer dead or hung: the agreement or the closing barrier raises, the
rank is stuck in a collective, or an error already ended the loop) leaves promptly when told to
go, without a save, with the same exit code: diag.trainer.graceful.abandon has the rule,
diag.trainer.graceful.stuckwatch acts on it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from diag.formats.rundir import RankIdentity, default_run_dir
from diag.formats.snapshot import LATEST_FILE, TRACKER_FILE, read_latest_step, step_tag
from diag.trainer.control.commands import Agreement, agree, command_group
from diag.trainer.control.period import AgreementPeriod
from diag.trainer.graceful.abandon import Phase
from diag.trainer.graceful.stopflag import (
    DRAIN_SIGNALS,
    StopFlag,
    StopFlagSettings,
    consume_stop_file,
    stop_file_present,
    stop_flag,
)
from diag.trainer.graceful.stuckwatch import DrainWatch
from diag.trainer.graceful.teardown import (
    exit_process,
    leave_after_exit_handlers,
    quiesce_at_exit,
)
from diag.trainer.stephooks import StepHook, add_step_hook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stopped:
    step: int  # the step saved
    reason: str  # this rank's request ("SIGTERM", "stop file ...") or "another rank's request"
    via: str  # "flash" or "storage"
    exit_code: int
    seconds: float  # from this rank's request (or the agreement) to the save's end


class GracefulExit:
    def __init__(
        self,
        engine: Any,
        save_dir: str | os.PathLike[str] | None = None,
        *,
        checkpointer: Any = None,
        stop_file: str | os.PathLike[str] | None = None,
        max_latency_s: float | None = None,
        max_overhead: float | None = None,
        every: int | None = None,
        exit_code: int | None = None,
        signals: tuple[Any, ...] = DRAIN_SIGNALS,
        client_state: Any = None,
        exit: bool = True,
        flag: StopFlag | None = None,
        config: StopFlagSettings | None = None,
    ) -> None:
        import torch.distributed as dist

        if save_dir is None and checkpointer is None:
            raise ValueError("graceful_exit needs a save_dir (or a checkpointer that has one)")
        quiesce_at_exit()
        self.engine = engine
        self.checkpointer = checkpointer
        self.save_dir = os.path.abspath(os.fspath(save_dir or checkpointer.save_dir))
        self.config = config or StopFlagSettings.resolve(
            stop_file=stop_file, max_latency_s=max_latency_s, max_overhead=max_overhead,
            every=every, exit_code=exit_code, run_dir=default_run_dir(),
        )  # fmt: skip
        self.period = AgreementPeriod(self.config.period)
        self.client_state = client_state  # a dict, or a callable returning one, saved with it
        self.exit = exit
        self.flag = flag or stop_flag()
        self.stopped: Stopped | None = None
        self.enabled = True  # False: no agreements (a benchmark's baseline)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        ident = RankIdentity.from_env() if "RANK" in os.environ else None
        self.local_rank = ident.local_rank if ident else self.rank
        if checkpointer is not None:
            self._group = checkpointer._group
            checkpointer.delegate_boundary(self)
        else:
            self._group = command_group(dist) if distributed else None  # collective
        self._boundary = int(getattr(engine, "global_steps", 0))
        self._file_seen = False
        self.flag.install(signals)
        self.watch = DrainWatch(self.flag, lambda: self.period.step_seconds, self.config.exit_code)
        self.watch.start(tuple(signals))
        atexit.register(self._at_exit)
        self._hook_step()

    # -- the boundary ---------------------------------------------------------------------------

    def _hook_step(self) -> None:
        add_step_hook(self.engine, StepHook("graceful", after=self._after_step))

    def _after_step(self, engine: Any) -> None:
        self.at_boundary()

    def at_boundary(self) -> None:
        """Called after every engine.step: agrees when due, and saves and leaves on a stop."""
        gs = int(getattr(self.engine, "global_steps", 0))
        if gs == self._boundary or not self.enabled or self.stopped is not None:
            return
        previous, self._boundary = self._boundary, gs
        if not self.period.advanced(previous, gs):
            return
        if not self.period.boundary(gs, time.monotonic()):
            return
        t0 = time.perf_counter()
        try:
            agreed = agree(self.vote(), self._group, self.world_size)
        except RuntimeError as e:  # gloo's errors: a peer is gone
            if not self.flag.is_set():
                raise
            self.watch.agreement_failed = True
            self._leave_unsaved(f"the ranks cannot agree on the stop: {e}")
        self.period.agreed(gs, agreed.every, time.perf_counter() - t0)
        if agreed.exit:
            self._stop(agreed, gs)
        elif agreed.flush and self.checkpointer is not None:
            self.checkpointer.act(agreed, gs)

    def vote(self) -> Agreement:
        # Only one rank per node looks at the stop file: a thousand ranks need not stat it.
        if self.local_rank == 0 and not self.flag.is_set() and self._check_file():
            self.flag.request(f"stop file {self.config.stop_file}")
        mine = self.flag.is_set()
        ckpt = self.checkpointer.vote() if self.checkpointer is not None else None
        return Agreement(
            flush=bool(ckpt and ckpt.flush),
            exit=mine or bool(ckpt and ckpt.exit),
            exit_code=max(self.config.exit_code if mine else 0, ckpt.exit_code if ckpt else 0),
            every=self.period.proposal(),
            no_agent=ckpt.no_agent if ckpt is not None else True,
        )

    def _check_file(self) -> bool:
        if stop_file_present(self.config.stop_file):
            self._file_seen = True
        return self._file_seen

    # -- the stop -------------------------------------------------------------------------------

    def _stop(self, agreed: Agreement, gs: int) -> None:
        request = self.flag.requested
        reason = request.reason if request else "another rank's request"
        began = request.monotonic if request else time.monotonic()
        log.warning("diag: stopping after step %d (%s): saving first", gs, reason)
        self.watch.phase = Phase.SAVING
        via = self._save(agreed, gs)
        self.watch.phase = Phase.DONE
        if self._file_seen:
            consume_stop_file(self.config.stop_file)
        self.stopped = Stopped(gs, reason, via, agreed.exit_code, time.monotonic() - began)
        log.warning(
            "diag: step %d saved (%s) %.2f s after the request; leaving with exit code %d",
            gs, via, self.stopped.seconds, agreed.exit_code,
        )  # fmt: skip
        if self.exit:
            exit_process(agreed.exit_code)

    def _save(self, agreed: Agreement, gs: int) -> str:
        import torch.distributed as dist

        state = self.client_state() if callable(self.client_state) else self.client_state
        ckpt = self.checkpointer
        if ckpt is not None and not agreed.no_agent:
            ok = ckpt.save(gs, state, persist=True)
            ckpt.report_pending(ok, gs, "" if ok else "save skipped")
            via = "flash" if ok else ""
        else:
            via = ""
        if not via:
            save_to_storage(self.engine, self.save_dir, gs, state or {}, self._group)
            if ckpt is not None:
                ckpt.report_pending(True, gs, "saved to storage by the ranks")
            via = "storage"
        if ckpt is not None:
            ckpt.close()  # hands pending persists to the agent, or removes the shared memory
        if self.world_size > 1:
            try:
                dist.barrier(group=self._group)  # nobody leaves before every rank's save returned
            except RuntimeError as e:  # a peer is gone: this rank's save is done, leave anyway
                log.error("diag: the drain's closing barrier failed (%s); leaving anyway", e)
        return via

    def _leave_unsaved(self, reason: str) -> NoReturn:
        log.error("diag: leaving without a save (%s); exit code %d", reason, self.config.exit_code)
        self.watch.phase = Phase.DONE  # decided here: the exit hook has nothing left to do
        exit_process(self.config.exit_code)

    def _at_exit(self) -> None:
        reason = self.watch.at_exit()
        if reason is not None:
            log.error(
                "diag: leaving without a save (%s); not finalizing, exit code %d",
                reason, self.config.exit_code,
            )  # fmt: skip
            leave_after_exit_handlers(self.config.exit_code)


def save_to_storage(
    engine: Any, save_dir: str, step: int, client_state: dict[str, Any], group: Any
) -> None:
    """`engine.save_checkpoint` of `step`, made safe against a kill at any moment: DeepSpeed's
    rank 0 writes `latest` as soon as its own files are written, so a kill in the middle could
    leave `latest` naming a step whose other ranks' files are missing. Here every rank writes
    and fsyncs its files first; `latest` (and DLRover's tracker file) are written by rank 0,
    atomically, only after all ranks are done, and only ever move forward."""
    import torch.distributed as dist

    tag = step_tag(step)
    written = _record_saves(engine)
    try:
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    finally:
        _stop_recording(engine)
    for path in written:
        _fsync(Path(path))
    _fsync_dir(Path(save_dir) / tag)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier(group=group)
    if not distributed or dist.get_rank() == 0:
        latest = read_latest_step(save_dir)
        if latest is None or step > latest:
            _write_atomic(Path(save_dir) / LATEST_FILE, tag)
            _write_atomic(Path(save_dir) / TRACKER_FILE, str(step))
    if distributed:
        dist.barrier(group=group)


def _record_saves(engine: Any) -> list[str]:
    """Notes the paths this rank's checkpoint engine writes (to fsync them, and only them)."""
    written: list[str] = []
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or not hasattr(ce, "save"):
        return written
    orig = ce.save

    def save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        result = orig(state_dict, path, *args, **kwargs)
        written.append(str(path))
        return result

    ce.save = save
    ce._diag_orig_save = orig
    return written


def _stop_recording(engine: Any) -> None:
    ce = getattr(engine, "checkpoint_engine", None)
    orig = getattr(ce, "_diag_orig_save", None)
    if ce is not None and orig is not None:
        ce.save = orig
        del ce._diag_orig_save


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Some filesystems refuse fsync on directories; the files themselves are synced.
    with contextlib.suppress(OSError):
        _fsync(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def graceful_exit(
    engine: Any, save_dir: str | os.PathLike[str] | None = None, **kwargs: Any
) -> GracefulExit:
    """Drains this DeepSpeed job on SIGTERM, SIGINT, SIGUSR1, SIGUSR2 and the stop file; see
    the module's docstring and GracefulExit's arguments."""
    return GracefulExit(engine, save_dir, **kwargs)
