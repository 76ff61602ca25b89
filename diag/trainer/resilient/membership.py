"""This rank's membership in the world, one generation at a time: the base store (torchrun's
agent store, which outlives the ranks), the process groups of each generation under their own
key space, the fault posted for a generation, and the watcher thread that aborts this rank's
groups and interrupts its main thread when another rank posts one (or the agent's verdict comes).

Aborting happens on the watcher thread: the main thread may be blocked in a collective, which
only returns once the peers' connections close. Gloo's abort closes this rank's connections, so
every peer blocked on it fails at once; NCCL's (`_abort_process_group`, all communicators in one
group call) does the same on a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from diag.trainer.resilient import storekeys as keys
from diag.trainer.resilient.waiting import Graveyard

log = logging.getLogger(__name__)

INTERRUPT_SIGNAL = signal.SIGRTMIN + 5  # unused by torch, Python and diag's graceful exit
POLL_S = 0.05
_UNRELEASED: list[Graveyard] = []  # kept to the process's end: freeing them would block
FORM_TIMEOUT_S = 300.0  # every rank joins a generation within this (a slow one tears down first)
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


class Interrupted(BaseException):
    """Raised in the main thread when its generation had a fault (a BaseException, so that a
    training loop's `except Exception` does not swallow it)."""


class RecoveryError(RuntimeError):
    """In-place recovery could not go on; the launcher restarts every rank."""


@dataclass(frozen=True)
class WorldSpec:
    backend: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (it outlives the ranks)
    attempt: int  # torchrun's restart count: a full restart gets fresh keys
    timeout_s: float  # collectives: a peer late by this much is a fault
    call: int = 0  # which `resilient` run of this process (the same on every rank)
    join: bool = False  # a replacement: joins the generation the survivors form next

    @classmethod
    def from_env(cls, env: Mapping[str, str], backend: str, timeout_s: float) -> WorldSpec:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RecoveryError(
                f"resilient needs a launcher's environment ({', '.join(missing)} unset): start "
                "the script with torchrun, dlrover-run or diag launch"
            )
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            port = int(env["MASTER_PORT"])
            local = int(env.get("LOCAL_RANK", "0"))
            attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError as e:
            raise RecoveryError(f"a launcher variable is not a number ({e})") from None
        if not (0 <= rank < world) or not (0 < port < 65536):
            raise RecoveryError(f"RANK {rank} of WORLD_SIZE {world}, MASTER_PORT {port}: invalid")
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        join = env.get(keys.JOIN_ENV, "") == "1"
        return cls(backend, rank, world, local, env["MASTER_ADDR"], port, agent, attempt,
                   float(timeout_s), join=join)  # fmt: skip

    def key(self, generation: int, name: str = "") -> str:
        return keys.generation_key(self.attempt, self.call, generation, name)


class Membership:
    def __init__(self, spec: WorldSpec) -> None:
        import torch.distributed as dist

        self.spec = spec
        self.generation = 0
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # Without torchrun's agent store rank 0 hosts it: a fault that takes rank 0's process
        # takes the store with it (then forming the next generation fails: a full restart).
        host = not spec.agent_store and spec.rank == 0
        self._store = dist.TCPStore(
            spec.master_addr, spec.master_port, spec.world_size if host else None, host,
            timeout=timeout, wait_for_workers=False,
        )  # fmt: skip
        # The watcher's own connection: a store client serves one thread at a time.
        self._watch_store = dist.TCPStore(
            spec.master_addr, spec.master_port, None, False, timeout=timeout
        )
        self._lock = threading.Lock()
        self._faulted: int | None = None  # the generation this rank knows had a fault
        # A replacement learns its generation (and run) before the watcher starts; until it has
        # formed it, the watcher stays quiet (a fault of the world it replaces is not its own).
        self.first_generation = self._join() if spec.join else 0
        self.generation = self.first_generation
        self._recovering = spec.join
        with contextlib.suppress(Exception):  # diag launch replaces this rank alone if it dies
            self._store.set(keys.member_key(spec.attempt, spec.rank), str(os.getpid()))
        self._reason = ""
        self._formed_at = 0.0  # Unix seconds: when this generation formed
        self.graveyard = Graveyard()
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._previous = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        self._watcher = threading.Thread(target=self._watch, name="diag-resilient", daemon=True)
        self._watcher.start()

    # -- generations -----------------------------------------------------------------------------

    def form(self, generation: int) -> None:
        """Makes the default group of `generation` (collective: every rank of the world)."""
        import torch.distributed as dist

        s = self.spec
        if s.backend == "nccl":
            _watchdog_hands_off()
        timeout = datetime.timedelta(seconds=s.timeout_s)
        _default_timeouts(timeout)
        # What a replacement reads to join this generation (every rank writes the same value).
        self._store.set(keys.forming_key(s.attempt), keys.forming_text(s.call, generation))
        store = dist.PrefixStore(s.key(generation, "pg/"), self._store)
        # The ranks arrive as they finish tearing the last generation down: a wait for the
        # slowest, not a collective on a hung peer. The collectives' timeout is set after.
        dist.init_process_group(
            s.backend, store=store, rank=s.rank, world_size=s.world_size,
            timeout=datetime.timedelta(seconds=max(FORM_TIMEOUT_S, s.timeout_s)),
        )  # fmt: skip
        dist.distributed_c10d._set_pg_timeout(timeout)
        self._store.set(s.key(generation, keys.joined_name(s.rank)), "1")
        with self._lock:
            self.generation = generation
            self._formed_at = time.time()
            self._faulted = None
            self._recovering = False
            self._reason = ""

    def begin_recovery(self) -> tuple[bool, bool, str]:
        """The main thread's attempt ended: from here no interrupt is raised in it. Returns
        (a fault was posted for this generation, this rank was told of one, why)."""
        with self._lock:
            self._recovering = True
            told, reason = self._faulted == self.generation, self._reason
        posted = told or self._posted(self._store, self.generation)
        return posted, told, reason

    def fault_reason(self) -> str:
        """The fault this rank was told of for its generation ("" if none)."""
        with self._lock:
            return self._reason

    def post(self, reason: str) -> None:
        """Tells every rank that this generation had a fault (idempotent: the first one stays)."""
        with contextlib.suppress(Exception):
            key = self.spec.key(self.generation, "fault")
            self._store.compare_set(key, "", f"rank {self.spec.rank}: {reason}"[:300])

    def abort(self) -> None:
        """Aborts every process group of this rank (all of them, NCCL's in one group call)."""
        import torch.distributed as dist

        if dist.is_initialized():
            if self.spec.backend == "gloo":  # freed only once no abandoned work runs in them
                self.graveyard.keep(list(dist.distributed_c10d._world.pg_map))
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()
        if self.spec.backend == "nccl":
            _settle_cuda()

    def interrupt(self, reason: str) -> None:
        """A fault in this generation, known here first (the agent's verdict): every rank is told,
        this rank's groups are aborted and its main thread interrupted. Thread-safe."""
        self.post(reason)
        self._fault(self.generation, reason)

    def on_verdict(self, reason: str, verdict_time: float) -> str:
        """The agent's hang verdict, reached at `verdict_time` (Unix seconds, 0: unknown): a
        fault in this generation unless the world formed again after it (the ranks' own
        timeout came first). Returns what this rank does, in words."""
        with self._lock:
            g, formed = self.generation, self._formed_at
            busy = self._faulted == g or self._recovering
        if busy:
            return f"recovering in place already (generation {g})"
        if g and verdict_time and formed > verdict_time:
            return f"recovered already: generation {g} formed {formed - verdict_time:.1f} s after the verdict"
        self.interrupt(reason)
        return f"recovering in place from generation {g}"

    def close(self) -> None:
        # Past its `resilient` run a rank no longer recovers in place: its death is a restart.
        with contextlib.suppress(Exception):
            self._store.delete_key(keys.member_key(self.spec.attempt, self.spec.rank))
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        if self.graveyard.release():  # a work still runs: not freed here, on the main thread
            _UNRELEASED.append(self.graveyard)
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(INTERRUPT_SIGNAL, self._previous)
        self._watch_store = self._store = None  # their connections close with them

    def _join(self) -> int:
        """A replacement's generation: the one the survivors form next. The ranks write the
        generation they begin forming; when this rank's predecessor was a member of it (it died
        after that world formed), the survivors form the one after, once they know of the
        fault: a dead peer's collective fails, and the fault is posted here too in case they
        are not in one. Sets this run's counter to theirs."""
        s = self.spec
        key = keys.forming_key(s.attempt)
        try:
            self._store.wait([key], datetime.timedelta(seconds=FORM_TIMEOUT_S))
            got = keys.parse_forming(bytes(self._store.get(key)))
        except Exception as e:
            raise RecoveryError(f"a replacement found no generation to join ({e})") from e
        if got is None:
            raise RecoveryError(f"a replacement read a malformed {key!r} from the store")
        call, generation = got
        self.spec = s = replace(s, call=call)
        if self._store.check([s.key(generation, keys.joined_name(s.rank))]):
            with contextlib.suppress(Exception):
                self._store.compare_set(
                    s.key(generation, "fault"), "", f"rank {s.rank}: its process died; replaced"
                )
            generation += 1
        log.warning("diag: rank %d takes a dead rank's place in generation %d", s.rank,
                    generation)  # fmt: skip
        return generation

    # -- the watcher -----------------------------------------------------------------------------

    def _posted(self, store: Any, generation: int) -> bool:
        try:
            return bool(store.check([self.spec.key(generation, "fault")]))
        except Exception:  # the store is gone (its host died): a fault too
            return True

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self.graveyard.release()
            with self._lock:
                g, quiet = self.generation, self._faulted is None and not self._recovering
            if quiet and self._posted(self._watch_store, g):
                self._fault(g, self._read_reason(g))

    def _read_reason(self, generation: int) -> str:
        try:
            raw = bytes(self._watch_store.get(self.spec.key(generation, "fault")))
        except Exception as e:
            return f"the store did not answer ({e})"
        return reason_text(raw)

    def _fault(self, generation: int, reason: str) -> None:
        with self._lock:
            if generation != self.generation or self._faulted == generation:
                return
            self._faulted, self._reason = generation, reason
            recovering = self._recovering
        log.warning("diag: fault in generation %d (%s): aborting this rank's groups",
                    generation, reason)  # fmt: skip
        self.abort()
        if not recovering and self._main is not None:
            with contextlib.suppress(Exception):
                signal.pthread_kill(self._main, INTERRUPT_SIGNAL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        with self._lock:
            raise_now = self._faulted == self.generation and not self._recovering
            if raise_now:
                self._recovering = True  # raised once: the attempt is over
            reason = self._reason
        if raise_now:
            raise Interrupted(reason)


def _watchdog_hands_off() -> None:
    """NCCL's watchdog leaves a failed communicator to the watcher (read by each NCCL group as it
    is made). torchrun hands its workers 1 (tear down), and torch's own default, 3, tears down
    too: either ends the whole process with SIGABRT at the first error a peer's abort causes
    (its sockets close), before this rank's watcher has seen the fault (measured on an H200)."""
    was = os.environ.get(NCCL_ERROR_HANDLING)
    if was != "0":
        os.environ[NCCL_ERROR_HANDLING] = "0"
        log.info("diag: %s=0 (was %s): a recovery in place aborts the communicators itself",
                 NCCL_ERROR_HANDLING, was)  # fmt: skip


def _default_timeouts(timeout: datetime.timedelta) -> None:
    """The groups the engine makes (DeepSpeed passes no timeout to `new_group`) time out as the
    world's do, not after torch's 30 minutes: a collective waiting on a hung peer then fails and
    starts the recovery. `_get_default_timeout` reads these module globals at each call."""
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def _settle_cuda() -> None:
    """After an NCCL abort: the device's pending work is dropped with the communicators (a GPU
    path; the CPU build never comes here)."""
    import torch

    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()


REASON_MAX = 500  # a reason is one line of a log: anyone who reaches the store may write it


def reason_text(raw: bytes) -> str:
    """A fault's reason as another rank posted it, bounded and printable."""
    text = raw[: REASON_MAX * 4].decode(errors="replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text[:REASON_MAX] + (" [cut]" if len(text) > REASON_MAX else "")
