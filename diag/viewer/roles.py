"""What each thread of a rank is for, told from what its stack holds, not from its name.

A training process runs one thread that trains (or a few: a pipeline's send/recv helpers) and a
dozen or more that help: the data loader's pin-memory thread and queue feeders, loggers, RPC
clients polling their channels, diag's own threads, and in native stacks the CUDA, NCCL, OpenMP
and intra-op pool threads. Their stacks differ from rank to rank with timing alone (a feeder
between two batches, a logger flushing), so comparing ranks on them finds differences that
mean nothing. Ranks are compared on their training threads; the others are drawn, grouped by
role.

The training threads of a rank are the threads inside a collective (a torch.distributed or
DeepSpeed comm frame) and the one its journal says issued the last op (see journals.py: a
training loop may run in a worker thread, and be outside any collective when dumped); when none
is known, the main thread. Threads the journal lists as diag's are diag's, whatever they run. A thread's other role comes from the
first frame, root first, that belongs to a known helper (`torch/utils/data/` is the data loader,
`multiprocessing/queues.py` a queue feeder, `logging/handlers.py` or TensorBoard a logger,
`grpc/` an RPC poller, diag's own packages diag); native threads that run no Python from their
native frames (NCCL's proxy and watchdog threads, OpenMP, BLAS, CUDA, gRPC core). Names are only
used to tell the main thread, and counters in names (`Thread-9`, `Thread-10`) are folded.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from diag.formats.stackdump import Frame, RankDump, ThreadStack
from diag.viewer.journals import JournalThreads


class Role(enum.StrEnum):
    TRAINING = "training"
    DATA_LOADER = "data loader"
    QUEUE_FEEDER = "queue feeder"
    LOGGING = "logging"
    RPC = "rpc"
    DIAG = "diag"
    COMM = "comm library"  # NCCL proxy threads, c10d watchdogs, gloo
    RUNTIME = "runtime"  # CUDA, OpenMP, BLAS, intra-op and autograd pools
    OTHER = "other"


# Drawing order of the groups, the training threads first.
ROLE_ORDER = tuple(Role)

_DIAG_DIRS = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + f"/{d}/"
    for d in ("trainer", "collector", "agent", "viewer")
)
# (role, pattern on a Python frame's file) in the order they are tried on one frame.
_PY_ROLES: tuple[tuple[Role, re.Pattern[str]], ...] = (
    (Role.DIAG, re.compile(r"/diag/(trainer|collector|agent|viewer)/")),
    (Role.DATA_LOADER, re.compile(r"/torch/utils/data/")),
    (Role.QUEUE_FEEDER, re.compile(r"/multiprocessing/(queues|pool|managers)\.py$")),
    (
        Role.LOGGING,
        re.compile(r"/logging/|/tensorboard/|/tensorboardX/|/wandb/|/mlflow/|/loguru/|/aim/sdk/"),
    ),
    (
        Role.RPC,
        re.compile(
            r"/grpc/|/torch/distributed/rpc/|/zmq/|/xmlrpc/|/socketserver\.py$|/http/server\.py$"
            r"|/asyncio/base_events\.py$|/ray/_private/|/kubernetes/watch/"
        ),
    ),
)
_COLLECTIVE_FILES = re.compile(
    r"/torch/distributed/(distributed_c10d|c10d_logger|_functional_collectives|fsdp/|"
    r"_composable/fsdp/|tensor/)|/deepspeed/comm/|/megatron/core/pipeline_parallel/p2p"
)
_COLLECTIVE_NATIVE = re.compile(
    r"^c10d::(ProcessGroup\w*::(?!ncclCommWatchdog|heartbeat|watchdog|runHookLoop|runLoop)|Work\w*::wait)"
    r"|^(nccl|gloo::)(AllReduce|AllGather|Broadcast|ReduceScatter|Reduce|Send|Recv|GroupEnd|"
    r"allreduce|broadcast|barrier)"
)
_NATIVE_ROLES: tuple[tuple[Role, re.Pattern[str]], ...] = (
    (Role.COMM, re.compile(r"ncclProxy|ncclComm|ncclAsync|Watchdog|heartbeatMonitor|gloo::")),
    (Role.RPC, re.compile(r"grpc|gpr_|brpc|bthread")),
    (
        Role.RUNTIME,
        re.compile(
            r"libgomp|libiomp|gomp_|omp_|blas_thread|openblas|ThreadPool|autograd::Engine|tbb::|libcuda|cuda|at::internal"
            r"|jemalloc|background_thread"
        ),
    ),
)
# Frames of the interpreter that a native unwinder shows: a thread with them runs Python.
_INTERPRETER = re.compile(r"_PyEval_EvalFrame|PyEval_EvalCode|Py_RunMain|Py_BytesMain")
_MAIN_NATIVE = re.compile(r"^(Py_RunMain|Py_BytesMain|pymain_run_python)$")
_BOOTSTRAP = re.compile(r"/threading\.py$")
_COUNTER = re.compile(r"\d+")
MAIN_THREAD = "MainThread"


def thread_label(name: str) -> str:
    """A thread's name with its counters folded: `Thread-10 (_monitor)` and `Thread-9
    (_monitor)` both read `Thread-N (_monitor)`."""
    return _COUNTER.sub("N", name)


def _in_diag(file: str) -> bool:
    return file.startswith(_DIAG_DIRS)


def in_collective(frames: Sequence[Frame]) -> bool:
    """Inside a collective or point-to-point op: a torch.distributed or DeepSpeed comm frame, or
    native c10d/NCCL frames that Python called."""
    for f in frames:
        if f.native:
            if _COLLECTIVE_NATIVE.search(f.func):
                return True
        elif _COLLECTIVE_FILES.search(f.file):
            return True
    return False


def _python_role(frames: Sequence[Frame]) -> Role | None:
    for f in frames:
        if f.native:
            continue
        if _in_diag(f.file):
            return Role.DIAG
        if _BOOTSTRAP.search(f.file):
            continue
        for role, pattern in _PY_ROLES:
            if pattern.search(f.file):
                return role
    return None


def _native_role(frames: Sequence[Frame]) -> Role | None:
    for f in frames:
        if not f.native:
            continue
        text = f"{f.func} {f.module or f.file}"
        for role, pattern in _NATIVE_ROLES:
            if pattern.search(text):
                return role
    return None


def runs_python(frames: Sequence[Frame]) -> bool:
    return any(not f.native or _INTERPRETER.search(f.func) for f in frames)


def _is_main_native(frames: Sequence[Frame]) -> bool:
    return any(f.native and _MAIN_NATIVE.match(f.func) for f in frames[:16])


@dataclass(frozen=True)
class ThreadRoles:
    """Roles of one list of threads (a dump's `threads` or `native_threads`), index by index."""

    roles: tuple[Role, ...]

    @property
    def training(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles) if r is Role.TRAINING)


class RoleCache:
    """Remembers the role content gives each distinct stack (the dumps share frame tuples), so
    that thousands of ranks cost a lookup per thread, and the roles of each dump. `journals`:
    what the ranks' journal tails say about their threads, by rank."""

    def __init__(self, journals: dict[int, JournalThreads] | None = None) -> None:
        self._content: dict[int, tuple[tuple[Frame, ...], Role | None, bool, bool]] = {}
        self._dumps: dict[int, tuple[RankDump, tuple[ThreadRoles, ThreadRoles]]] = {}
        self.journals = journals or {}

    def content(self, frames: tuple[Frame, ...]) -> tuple[Role | None, bool, bool]:
        """(role from the frames, or None; in a collective (running Python); the main thread's
        native start-up frames)."""
        found = self._content.get(id(frames)) or self._remember(frames)
        return found[1], found[2], found[3]

    def _remember(
        self, frames: tuple[Frame, ...]
    ) -> tuple[tuple[Frame, ...], Role | None, bool, bool]:
        role = _python_role(frames)
        if role is None:
            role = _native_role(frames)
        coll = in_collective(frames) and runs_python(frames)
        # keeps `frames` alive, so its id stays unique
        found = self._content[id(frames)] = (frames, role, coll, _is_main_native(frames))
        return found

    def of_dump(self, dump: RankDump) -> tuple[ThreadRoles, ThreadRoles]:
        found = self._dumps.get(id(dump))
        if found is None:
            found = self._dumps[id(dump)] = (dump, _dump_roles(dump, self))
        return found[1]


def _assign(
    threads: Sequence[ThreadStack],
    cache: RoleCache,
    pid: int,
    native: bool,
    known: dict[int, Role] | None = None,
    journal: JournalThreads | None = None,
) -> ThreadRoles:
    """Roles of one list of threads of a process `pid`: `native` ones (a separate unwinder's,
    whose main thread shows the interpreter's start-up frames) or Python ones (the main thread
    by its name). `known`: roles of the Python threads by OS thread id, which the native ones
    take over. Runs for every thread of every rank: one content lookup per thread."""
    content, remember = cache._content, cache._remember
    roles: list[Role | None] = []
    collective: list[bool] = []  # trains: in a collective, or the journal's issuer
    is_main: list[bool] = []
    for t in threads:
        frames, os_tid = t.frames, t.os_tid
        c = content.get(id(frames)) or remember(frames)
        own = pid > 0 and os_tid == pid
        is_main.append((own or c[3]) if native else (own or t.name == MAIN_THREAD))
        if known is not None and os_tid in known:
            r = known[os_tid]
            roles.append(r)
            collective.append(r is Role.TRAINING)
            continue
        role, coll = c[1], c[2]
        if journal is not None and os_tid:
            if os_tid in journal.own:
                role, coll = Role.DIAG, False
            elif os_tid == journal.issuer:
                coll = True
        roles.append(role)
        collective.append(coll)
    training = [i for i, c in enumerate(collective) if c]
    if not training and known is not None:
        training = [i for i, r in enumerate(roles) if r is Role.TRAINING]
    if not training:
        main = [i for i, m in enumerate(is_main) if m]
        if main:
            training = main[:1]
        else:  # no main thread known: the deepest thread that runs Python and helps nobody
            pool = [i for i, t in enumerate(threads) if roles[i] is None and runs_python(t.frames)]
            pool = pool or [i for i, r in enumerate(roles) if r is None]
            if pool:  # else every thread helps: the rank has no training thread
                training = [max(pool, key=lambda i: len(threads[i].frames))]
    out = []
    for i, r in enumerate(roles):
        if i in training:
            out.append(Role.TRAINING)
        else:
            out.append(r if r is not None and r is not Role.TRAINING else Role.OTHER)
    return ThreadRoles(tuple(out))


def dump_roles(dump: RankDump, cache: RoleCache | None = None) -> tuple[ThreadRoles, ThreadRoles]:
    """Roles of a dump's `threads` and of its `native_threads`. A native thread that is one of
    the Python threads (same OS thread id) has that thread's role."""
    return (cache or RoleCache()).of_dump(dump)


def _dump_roles(dump: RankDump, cache: RoleCache) -> tuple[ThreadRoles, ThreadRoles]:
    journal = cache.journals.get(dump.rank)
    py = _assign(dump.threads, cache, dump.pid, False, None, journal)
    if not dump.native_threads:
        return py, ThreadRoles(())
    known = {t.os_tid: r for t, r in zip(dump.threads, py.roles, strict=True) if t.os_tid}
    native = _assign(dump.native_threads, cache, dump.pid, True, known or None, journal)
    return py, native
