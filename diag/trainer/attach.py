"""`attach()`: instrument this rank so the agent can see what it is doing.

    import diag.trainer
    engine, *_ = deepspeed.initialize(...)
    diag.trainer.attach(engine)          # collectives, steps and checkpoints are now journaled
    with diag.trainer.phase("eval"):      # phases have their own hang limits in the agent
        evaluate()

Works the same under torchrun, the deepspeed launcher and dlrover-run: the identity comes from
the environment they set. Never imports the agent.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from diag.collector.frserver import FlightRecorderServer, enable_buffer
from diag.formats.journal import DEFAULT_CAPACITY, CloseReason, JournalStatus
from diag.formats.journalmeta import (
    GroupInfo,
    JournalMeta,
    journal_path,
    write_meta,
)
from diag.formats.journalwriter import JournalWriter
from diag.formats.rundir import (
    RankIdentity,
    default_run_dir,
    job_name,
    launcher_name,
    node_name,
    pid_namespace,
)
from diag.formats.worlds import group_in_world
from diag.trainer.graceful.teardown import quiesce_at_exit
from diag.trainer.stephooks import StepHook, add_step_hook

log = logging.getLogger(__name__)

_lock = threading.Lock()
_session: Session | None = None
_world = 0  # the generation of the world (diag.trainer.resilient forms it again after a fault)
# Whether attach() was called inside the training function diag.trainer.resilient runs (then it
# is called again in each attempt, as a replacement rank calls it in its first).
_in_attempt = False
_attached_in_attempt = False
OWN_THREADS_KEPT = 8
FLIGHT_RECORDER_ENV = "DIAG_FLIGHT_RECORDER"


class Session:
    """The instrumentation of one process: its journal, its patches, its engine hooks."""

    def __init__(self, run_dir: Path, job: str, ident: RankIdentity, capacity: int) -> None:
        import psutil

        from diag.collector.hooks import Instrumentation

        self.path = journal_path(run_dir, job, ident.rank)
        self.writer = JournalWriter(
            self.path,
            rank=ident.rank,
            world_size=ident.world_size,
            local_rank=ident.local_rank,
            attempt=ident.attempt,
            capacity=capacity,
        )
        self._meta_lock = threading.Lock()
        self.meta = JournalMeta(
            job=job,
            rank=ident.rank,
            world_size=ident.world_size,
            local_rank=ident.local_rank,
            local_world_size=ident.local_world_size,
            pid=os.getpid(),
            pid_start_time=psutil.Process().create_time(),
            node=node_name(),
            attempt=ident.attempt,
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
            launcher=launcher_name(),
            pid_ns=pid_namespace(),
        )
        write_meta(self.path, self.meta)
        self.instrumentation = Instrumentation(self.writer, self._on_new_group)
        self.instrumentation.install()
        self._last_step = 0
        self.flight_recorder = _serve_flight_recorder(self.path)

    def _on_new_group(self, index: int, pg: Any, ranks: tuple[int, ...], timeout: float) -> None:
        try:
            backend = pg._get_backend_name() if hasattr(pg, "_get_backend_name") else ""
        except Exception:
            backend = ""
        name = str(getattr(pg, "group_name", index))
        info = GroupInfo(
            index=index,
            # torch names groups afresh in each world ("0", "1", ...): the generation tells a
            # group of this world from its namesake of the last, the same on every member.
            name=group_in_world(name, _world),
            ranks=ranks,
            backend=str(backend),
            desc=str(getattr(pg, "group_desc", "")),
            timeout_s=timeout,
        )
        with self._meta_lock:
            device = self.meta.device
            if "nccl" in info.backend:
                device = "cuda"
            self.meta = replace(
                self.meta,
                groups=(*self.meta.groups, info),
                pg_timeout_s=self.meta.pg_timeout_s or self.instrumentation.pg_timeout_s,
                device=device,
            )
            write_meta(self.path, self.meta)

    def add_own_thread(self, native_id: int) -> None:
        """Records in the meta a thread diag started whose stack does not say so."""
        with self._meta_lock:
            if native_id in self.meta.own_threads:
                return
            # a thread per reconnection: the last few are the ones that may still run
            own = (*self.meta.own_threads, native_id)[-OWN_THREADS_KEPT:]
            self.meta = replace(self.meta, own_threads=own)
            write_meta(self.path, self.meta)

    # -- progress ----------------------------------------------------------------------------

    def step(self, n: int | None = None) -> None:
        self._last_step = self._last_step + 1 if n is None else n
        self.writer.step(self._last_step)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.writer.phase_begin(name)
        try:
            yield
        finally:
            self.writer.phase_end(name)

    def hook_engine(self, engine: Any) -> None:
        """Step boundaries from a DeepSpeed engine (its global step advances at the end of each
        gradient-accumulation boundary) and checkpoint save/load as phases."""
        if getattr(engine, "_diag_hooked", False):
            return
        add_step_hook(engine, StepHook("journal", after=self._after_step))
        for method, phase_name in (("save_checkpoint", "checkpoint"), ("load_checkpoint", "load")):
            orig = getattr(engine, method, None)
            if orig is not None:
                setattr(engine, method, self._in_phase(orig, phase_name))
        engine._diag_hooked = True

    def _after_step(self, engine: Any) -> None:
        global_steps = int(getattr(engine, "global_steps", 0))
        if global_steps != self._last_step:
            self.step(global_steps)

    def _in_phase(self, fn: Any, name: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return wrapper

    def close(
        self,
        status: JournalStatus = JournalStatus.CLOSED,
        reason: CloseReason = CloseReason.UNKNOWN,
    ) -> None:
        self.writer.close(status, reason)
        if self.flight_recorder is not None:
            self.flight_recorder.close()


def _serve_flight_recorder(journal: Path) -> FlightRecorderServer | None:
    """torch's flight recorder, on the agent's request (DIAG_FLIGHT_RECORDER=0: not served).
    Its ring is sized here when the job did not: that only works before the first process
    group, so attach() early."""
    if os.environ.get(FLIGHT_RECORDER_ENV, "1") == "0":
        return None
    if enable_buffer():
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                log.info(
                    "diag: attach() after init_process_group: the flight recorder keeps "
                    "torch's default ring size (set TORCH_FR_BUFFER_SIZE to choose it)"
                )
        except ImportError:
            pass
    return FlightRecorderServer.start(journal)


def attach(
    engine: Any = None,
    *,
    run_dir: str | os.PathLike[str] | None = None,
    job: str | None = None,
    capacity: int = DEFAULT_CAPACITY,
    control: bool = True,
) -> Session:
    """Instruments the current process (once; later calls only add the engine's hooks). With
    `control`, the rank also registers with the node's agent over the control channel (in the
    background; nothing waits for it), which lets the agent ask it for its stacks."""
    global _session, _attached_in_attempt
    with _lock:
        if _in_attempt:
            _attached_in_attempt = True
            if _session is not None:
                _session.instrumentation.resume()
        if _session is None:
            ident = _identity()
            directory = Path(run_dir) if run_dir is not None else default_run_dir()
            _session = Session(directory, job or job_name(), ident, capacity)
            _install_exit_hooks(_session)
            log.info("diag: journaling rank %d to %s", ident.rank, _session.path)
            if control:
                _start_control(_session, directory, ident)
        if engine is not None:
            _session.hook_engine(engine)
        return _session


def _start_control(session: Session, run_dir: Path, ident: RankIdentity) -> None:
    from diag.trainer.control.identity import ClientIdentity
    from diag.trainer.control.shared import shared_client

    m = session.meta
    client_ident = ClientIdentity(
        m.job, ident.rank, ident.world_size, ident.local_rank, ident.attempt, m.node, m.pid,
        m.pid_start_time, m.pid_ns,
    )  # fmt: skip
    client = shared_client(run_dir, client_ident, journal=str(session.path))
    if client is not None:
        client.watch_own_threads(session.add_own_thread)


def current() -> Session | None:
    return _session


def new_world(generation: int) -> None:
    """The process group was formed again in place (generation `generation`): the journal's
    groups from here on are new ones, named apart from the last world's.

    Every rank of a world must count a group's ops from the same point of the program, or the
    agent matches the wrong ops across ranks (a rank seen one op behind is called a leaver). A
    replacement rank counts from its attach(): when the survivors called attach() inside the
    training function, they count from their next call too (their ops before it, the engine's
    set-up, go unrecorded, as in the first world); when attach() came before the wrapper, every
    rank counts from the world's formation."""
    global _world, _attached_in_attempt
    with _lock:
        _world = generation
        if _session is not None:
            _session.instrumentation.forget_groups(pause=_attached_in_attempt)
        _attached_in_attempt = False


@contextlib.contextmanager
def in_attempt() -> Iterator[None]:
    """diag.trainer.resilient runs one attempt of the training function inside this."""
    global _in_attempt
    _in_attempt = True
    try:
        yield
    finally:
        _in_attempt = False


def step(n: int | None = None) -> None:
    """Marks a training-step boundary (not needed when attach() was given the engine)."""
    if _session is not None:
        _session.step(n)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A named phase (eval, checkpoint, data loading...) whose hang limit the agent sets apart."""
    if _session is None:
        yield
        return
    with _session.phase(name):
        yield


def mark(name: str) -> None:
    if _session is not None:
        _session.writer.mark(name)


def _identity() -> RankIdentity:
    ident = None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        ident = RankIdentity.from_env()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            base = ident or RankIdentity(dist.get_rank(), dist.get_world_size(), 0, 1, 0)
            ident = replace(base, rank=dist.get_rank(), world_size=dist.get_world_size())
    except ImportError:
        pass
    if ident is None:
        ident = RankIdentity.from_env()  # raises with a message saying what to do
    return ident


def _install_exit_hooks(session: Session) -> None:
    quiesce_at_exit()  # first: its handler then runs after the others
    atexit.register(session.close, JournalStatus.CLOSED, CloseReason.EXIT)
    _close_on_destroy(session)
    previous = sys.excepthook

    def excepthook(tp: Any, value: Any, tb: Any) -> None:
        session.close(JournalStatus.FAILED)
        previous(tp, value, tb)

    sys.excepthook = excepthook


def _close_on_destroy(session: Session) -> None:
    """Destroying the default process group ends the rank's communication: the journal is closed
    then, not at interpreter exit, so the agent does not judge a rank tearing down (which can
    take seconds) as stuck."""
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return
    orig = c10d.destroy_process_group
    if getattr(orig, "_diag_wrapped", False):
        return

    def destroy_process_group(group: Any = None) -> None:
        if group is None:
            session.close(JournalStatus.CLOSED, CloseReason.LEFT_GROUP)
        return orig(group)

    destroy_process_group._diag_wrapped = True  # type: ignore[attr-defined]
    destroy_process_group.__wrapped__ = orig  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
