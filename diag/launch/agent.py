"""The elastic agent of `diag launch`: torch.distributed.elastic's SimpleElasticAgent (its
rendezvous, rank assignment, restarts and exit barrier) with its own workers and monitor loop.
torchrun's process context stops every worker when one fails; here each worker is a process of
its own, and the pure policy (diag.launch.workerpolicy) decides, at each look, whether a failed
one is replaced alone or every worker restarts as under torchrun."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import signal
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

from diag.formats.exitcodes import UsageError
from diag.launch import workerpolicy as core
from diag.launch.spare import Order
from diag.launch.workers import Proc, Spares, start_cold, stop
from diag.trainer.resilient import storekeys as keys

log = logging.getLogger(__name__)

DEFAULT_ROLE = "default"
STORE_TIMEOUT_S = 10.0  # the launcher's own reads of the job's store
MEMBER_LOOK_S = 0.5  # between looks for a worker under `resilient`, until one is seen


class SpareAgent(SimpleElasticAgent):
    def __init__(self, spec: WorkerSpec, rules: core.Policy, shutdown_timeout: int = 30) -> None:
        # torch before 2.13 has no `shutdown_timeout` here (2.11's agent takes the spec alone).
        takes = "shutdown_timeout" in inspect.signature(SimpleElasticAgent.__init__).parameters
        super().__init__(spec, **({"shutdown_timeout": shutdown_timeout} if takes else {}))
        self._rules = rules
        self._procs: dict[int, Proc] = {}  # local rank -> the process holding it now
        self._spares = Spares(rules.spares)
        self._replaced = 0  # replacements made: each spends one of --max-restarts
        self._client: Any = None  # a client of the workers' store (MASTER_ADDR:MASTER_PORT)
        self._worker_store: Any = None  # node 0: the workers' store of this attempt
        self.outcome = ""  # why the launch ended, one line
        self._spares_at: float | None = None  # when spares start (_fill_spares)
        self._next_member_look = 0.0

    # -- SimpleElasticAgent's hooks ----------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torchrun's rendezvous, then a store of this attempt's own for the workers, hosted by
        the node-0 launcher (it outlives the ranks, as torchrun's agent store): the store
        torchrun shares across restarts keeps the last attempt's keys, and the restarted ranks'
        gloo connect then reads a dead rank's address (seen under torchrun itself, a rank
        killed, torch 2.13)."""
        super()._rendezvous(worker_group)
        import torch.distributed as dist

        wg = worker_group
        # The c10d rendezvous's store is prefixed per round already, and its nodes' restart
        # counts differ (a restart for a node waiting to join spends none); the static one's is
        # not, and its nodes only ever restart together.
        restart_count = wg.spec.max_restarts - self._remaining_restarts
        static = spec_backend(wg.spec) == "static"
        key = f"diag/launch/store/{restart_count}" if static else "diag/launch/store"
        store = self._store
        assert store is not None
        if wg.group_rank == 0:
            self._worker_store = dist.TCPStore(
                "0.0.0.0", 0, None, True, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
                wait_for_workers=False,
            )  # fmt: skip
            store.set(key, str(self._worker_store.port))
        wg.master_port = port_of(bytes(store.get(key)), key)
        self._client = None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        now = time.monotonic()
        self._procs = {}
        argv = self._argv()
        for worker in worker_group.workers:
            env = _worker_env(worker_group, worker, restart_count)
            popen = start_cold(argv, env)
            self._procs[worker.local_rank] = Proc(worker.local_rank, worker.global_rank, env,
                                                  popen, now)  # fmt: skip
        self._client = None
        return {lr: p.pid for lr, p in self._procs.items()}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        stop([p.popen for p in self._procs.values()], float(self._shutdown_timeout))

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        facts = self._facts(time.monotonic())
        if any(w.state is core.State.FAILED for w in facts.workers):
            return RunResult(state=WorkerState.FAILED)
        if all(w.state is core.State.SUCCEEDED for w in facts.workers):
            return RunResult(state=WorkerState.SUCCEEDED)
        return RunResult(state=WorkerState.HEALTHY)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        stop([p.popen for p in self._procs.values()], float(timeout), death_sig)
        self._spares.close(float(timeout))

    # -- the monitor loop ---------------------------------------------------------------------------

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        wg = self._worker_group
        spec = wg.spec
        self._initialize_workers(wg)
        while True:
            time.sleep(spec.monitor_interval)
            now = time.monotonic()
            d = core.decide(self._rules, self._facts(now), now)
            if d.action is core.Action.CONTINUE:
                self._fill_spares(now)
                if spec.rdzv_handler.num_nodes_waiting() > 0:  # as torchrun: not a failure
                    log.warning("diag launch: nodes wait to join: restarting every worker")
                    self._restart_workers(wg)
                continue
            if d.action is core.Action.DONE:
                wg.state = WorkerState.SUCCEEDED
                self.outcome = d.reason
                self._exit_barrier()
                return RunResult(state=WorkerState.SUCCEEDED,
                                 return_values={p.rank: None for p in self._procs.values()})  # fmt: skip
            if d.action is core.Action.REPLACE_ONE:
                assert d.local_rank is not None
                log.warning("diag launch: %s", d.reason)
                self._replaced += 1
                self._replace(d.local_rank, d.warm, now)
                continue
            if d.action is core.Action.RESTART_ALL:
                log.warning("diag launch: restarting every worker: %s", d.reason)
                self._remaining_restarts -= 1
                self._restart_workers(wg)
                continue
            log.error("diag launch: the job failed: %s", d.reason)
            self.outcome = d.reason
            self._stop_workers(wg)
            wg.state = WorkerState.FAILED
            return RunResult(state=WorkerState.FAILED)

    def _facts(self, now: float) -> core.Facts:
        workers = []
        for p in self._procs.values():
            code = p.popen.poll()
            state = (core.State.RUNNING if code is None
                     else core.State.SUCCEEDED if code == 0 else core.State.FAILED)  # fmt: skip
            resilient = state is core.State.FAILED and self._recovers_in_place(p)
            workers.append(core.Worker(p.local_rank, p.rank, state, code, resilient,
                                       p.started_at, p.replacement, p.replacements))  # fmt: skip
        left = core.failures_left(self._remaining_restarts, self._replaced)
        return core.Facts(tuple(workers), left, self._spares.ready(), self._spares.warm())

    def _recovers_in_place(self, p: Proc) -> bool:
        """Whether the dead worker's rank said it runs under diag.trainer.resilient (a key in
        the workers' store, under this launch attempt's keys)."""
        try:
            return self._is_member(p)
        except Exception as e:  # no store, no answer: torchrun's restart
            log.info("diag launch: could not read whether rank %d recovers in place (%s)",
                     p.rank, e)  # fmt: skip
            return False

    def _is_member(self, p: Proc) -> bool:
        attempt = int(p.env["TORCHELASTIC_RESTART_COUNT"])
        return bool(self._store_client().check([keys.member_key(attempt, p.rank)]))

    def _store_client(self) -> Any:
        if self._client is None:
            import torch.distributed as dist

            wg = self._worker_group
            self._client = dist.TCPStore(
                str(wg.master_addr), int(wg.master_port or 0), None, False,
                timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            )  # fmt: skip
        return self._client

    def _replace(self, local_rank: int, warm: bool, now: float) -> None:
        """The dead worker's rank, taken by a warm spare (or a new process): the same
        environment, with the marker that makes it join the survivors' next generation."""
        dead = self._procs[local_rank]
        env = {**dead.env, keys.JOIN_ENV: "1"}
        argv = self._argv()
        popen = self._spares.take(Order(env, argv)) if warm else None
        if popen is None:
            if warm:
                log.warning("diag launch: no spare took rank %d: starting a new process",
                            dead.rank)  # fmt: skip
            popen = start_cold(argv, env)
        self._procs[local_rank] = Proc(local_rank, dead.rank, dead.env, popen, now,
                                       replacement=True, replacements=dead.replacements + 1)  # fmt: skip
        self._spares.fill()  # the used spare's successor imports in the background

    def _fill_spares(self, now: float) -> None:
        """Spares start --spare-delay after a worker of this node is seen under `resilient`
        (only such a rank is replaced alone): never for a job that does not recover in place,
        and not while the workers build their engines, which their imports would slow."""
        if self._spares_at is None and now >= self._next_member_look and self._procs:
            self._next_member_look = now + MEMBER_LOOK_S
            # One worker's key: a job runs under the wrapper on every rank or on none. Quiet (a
            # store that does not answer is looked at again): this looks twice a second for as
            # long as a job without the wrapper runs.
            first = self._procs[min(self._procs)]
            with contextlib.suppress(Exception):
                if self._is_member(first):
                    self._spares_at = now + self._rules.spare_delay_s
        if self._spares_at is not None and now >= self._spares_at:
            self._spares.fill()

    def _argv(self) -> list[str]:
        """The script and its arguments (the spec's entrypoint is the script's path)."""
        spec = self._worker_group.spec
        return [str(spec.entrypoint), *map(str, spec.args)]


def port_of(raw: bytes, key: str) -> int:
    """The workers' store port the node-0 launcher wrote in the rendezvous store, checked:
    anything that reaches that store can write the key."""
    text = raw[:16].decode("ascii", errors="replace").strip()
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 65536):
        raise UsageError(
            f"the rendezvous store's {key!r} holds {raw[:32]!r}, not a port: is another launch "
            "using the same --rdzv-endpoint and --rdzv-id? Give each job its own --rdzv-id"
        )
    return int(text)


def spec_backend(spec: WorkerSpec) -> str:
    get = getattr(spec.rdzv_handler, "get_backend", None)
    return str(get()) if callable(get) else ""


def _worker_env(wg: WorkerGroup, worker: Any, restart_count: int) -> dict[str, str]:
    """A worker's variables, as torchrun's LocalElasticAgent sets them."""
    import os

    spec = wg.spec
    env = {
        "RANK": str(worker.global_rank),
        "GROUP_RANK": str(wg.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(wg.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": str(wg.master_addr),
        "MASTER_PORT": str(wg.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
        # The launcher hosts the workers' store (_rendezvous) whatever the rendezvous's own
        # choice (TORCH_DISABLE_SHARE_RDZV_TCP_STORE): rank 0 must not host one on its port.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LOCAL_RANK": str(worker.local_rank),
    }
    with contextlib.suppress(KeyError):
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env
