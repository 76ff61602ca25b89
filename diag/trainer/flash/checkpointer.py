"""`FlashCheckpointer`: DeepSpeed checkpoints saved to shared memory in about the time of a memory
copy, and written to storage in the background by the node's agent, which outlives the trainer.

    ckpt = diag.trainer.FlashCheckpointer(engine, "/ckpt/run1")   # on every rank
    step = ckpt.load() or 0                 # newest complete snapshot in memory, else storage
    for step in range(step + 1, total + 1):
        train_one_step(engine)
        ckpt.save(step)                     # memory only: ~ a memcpy of this rank's state
        if step % 100 == 0:
            ckpt.save(step, persist=True)   # and the agent writes it to /ckpt/run1

What lands on storage is DeepSpeed's own layout (`global_step{N}/...`, `latest`), so stock
`engine.load_checkpoint("/ckpt/run1")` reads it. `save` and `load` are collective: call them on all
ranks. Never imports the agent.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from diag.formats.rundir import (
    RankIdentity,
    default_run_dir,
    job_name,
    node_name,
    pid_namespace,
)
from diag.formats.snapshot import (
    SnapshotMeta,
    step_tag,
)
from diag.trainer.control.client import ControlClient
from diag.trainer.control.commands import Agreement, CommandBox, Pending, agree, command_group
from diag.trainer.control.identity import ClientIdentity, ResumeNote
from diag.trainer.control.period import AgreementPeriod, PeriodPolicy
from diag.trainer.control.shared import shared_client
from diag.trainer.flash import failwatch, live
from diag.trainer.flash import slotlayout as layout
from diag.trainer.flash.agreeing import agree_save, everyone, launch_id, plan_replicas
from diag.trainer.flash.capture import CapturedFile, capture_checkpoint
from diag.trainer.flash.copier import Copier, Copy
from diag.trainer.flash.flashstats import FlashStats as FlashStats
from diag.trainer.flash.replicating import Replication
from diag.trainer.flash.restore import FlashCheckpointError as FlashCheckpointError
from diag.trainer.flash.restore import Place, agent_wait_from_env
from diag.trainer.flash.resume import Source
from diag.trainer.flash.resuming import resume
from diag.trainer.flash.slots import RankSlots, SlotOwner
from diag.trainer.graceful.teardown import quiesce_at_exit
from diag.trainer.stephooks import StepHook, add_step_hook

log = logging.getLogger(__name__)

CLOSE_DRAIN_TIMEOUT_S = 5.0


class FlashCheckpointer:
    def __init__(
        self,
        engine: Any,
        save_dir: str | os.PathLike[str],
        *,
        run_dir: str | os.PathLike[str] | None = None,
        job: str | None = None,
        slots: int = 2,
        async_copy: bool = True,
        control: bool = True,
        exit_on_command: bool = True,
        command_every: int | None = None,
        period: PeriodPolicy | None = None,
        agent_wait: float | None = None,
    ) -> None:
        import psutil
        import torch.distributed as dist

        if not dist.is_initialized():
            raise FlashCheckpointError("initialize torch.distributed (deepspeed.initialize) first")
        if getattr(engine, "zero_nvme_offload_optimizer", lambda: False)():
            raise FlashCheckpointError("ZeRO NVMe offload keeps state on disk: not supported")
        self.engine = engine
        self.save_dir = os.path.abspath(os.fspath(save_dir))
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        self.job = job or job_name()
        self.node = node_name()
        try:  # an empty node's rank waits this long for its agent (its replica pull) at load()
            self.agent_wait = agent_wait_from_env() if agent_wait is None else float(agent_wait)
        except ValueError as e:
            raise FlashCheckpointError(str(e)) from None
        env = RankIdentity.from_env() if "RANK" in os.environ else None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = env.local_rank if env else self.rank
        attempt = env.attempt if env else 0
        self.stats = FlashStats()
        self.client_state: dict[str, Any] | None = None
        self.exit_on_command = exit_on_command
        self.async_copy = async_copy
        self.exit_requested = False
        # How often the ranks meet for agent commands: every `command_every` steps, else as the
        # step time and the stop-latency bound allow (diag.trainer.control.period).
        if period is None:
            period = PeriodPolicy(every=command_every) if command_every else PeriodPolicy()
        self.period = AgreementPeriod(period)
        self._owner: Any = None  # a GracefulExit that agrees for this engine instead
        self._closed = False
        self._scripts: dict[str, bytes] = {}
        self._copier = Copier(self._copied)
        self._slots = RankSlots(
            self.run_dir,
            SlotOwner(
                self.job,
                self.rank,
                self.world_size,
                self.local_rank,
                os.getpid(),
                psutil.Process().create_time(),
            ),
            count=slots,
        )
        self._slots.on_unmap = self._copier.pinned.release
        self._group = command_group(dist)
        self._run = launch_id(self.node, self._slots.owner, self._group, self.world_size)
        self._replication = Replication(self._slots, self._run)
        self._replica = self.rank in plan_replicas(
            engine, self.rank, self.node, self.local_rank, self.world_size, self._group
        )
        self._box = CommandBox()
        self._client: ControlClient | None = None
        if control:
            from diag.trainer.attach import current

            session = current()
            ident = ClientIdentity(
                self.job, self.rank, self.world_size, self.local_rank, attempt, self.node,
                os.getpid(), self._slots.owner.start_time, pid_namespace(),
            )  # fmt: skip
            journal = str(session.path) if session is not None else ""
            self._client = shared_client(self.run_dir, ident, journal=journal)
            if self._client is not None:
                self._client.on_command = self._on_command
                self._client.on_ack = self._on_ack
                self._client.on_replica = self._replication.acknowledged
                self._client.set_save_dir(self.save_dir)
        self._boundary = int(getattr(engine, "global_steps", 0))
        self._hook_step()
        failwatch.watch()
        quiesce_at_exit()
        atexit.register(self.close)
        live.opened(self)  # in-place recovery closes it after a fault (trainer.resilient)

    # -- save ----------------------------------------------------------------------------------

    def save(
        self, step: int, client_state: dict[str, Any] | None = None, *, persist: bool = False
    ) -> bool:
        """Snapshots this rank's full checkpoint state of `step` into shared memory; with
        `persist`, the agent then writes it to storage. Collective. Returns False when the save
        was skipped (every slot still waits for a persist).

        With `async_copy` (the default) the call returns once the state is captured: the bytes
        are copied in the background while the next forward and backward run (they do not
        change checkpointed state), and the next `engine.step()` waits for the copy to finish.
        Do not change model or optimizer state in between otherwise, or call `wait()` first."""
        from diag.trainer.attach import phase

        self.wait()
        t0 = time.perf_counter()
        with phase("checkpoint"):
            files = self._capture(step, client_state or {})
            entries, data_end = layout.plan_layout(files)
            described = SnapshotMeta(
                job=self.job, rank=self.rank, world_size=self.world_size,
                local_rank=self.local_rank, node=self.node, step=step, tag=step_tag(step),
                save_dir=self.save_dir, files=tuple(entries), device=layout.device_of(files),
                run=self._run,
            )  # fmt: skip
            # Whether it is a replication round's step is agreed below: room for either.
            metas = {
                r: layout.description(replace(described, replica_round=r)) for r in (False, True)
            }
            self._replication.prepare()
            got = self._slots.acquire(data_end + max(map(len, metas.values())))
            # All ranks save a step or none does: a step one rank skipped alone could never be
            # restored from memory, and it would push out the ranks' common older one. The same
            # all-reduce agrees on the replication rounds (trainer.flash.replicarounds).
            everyone, agreed = agree_save(
                (got is not None, self._replication.vote()), self._group, self.world_size
            )
            if not everyone:
                if got is not None:
                    got[1].unlock()
                self.stats.skipped += 1
                log.warning(
                    "diag: flash save of step %d skipped: %s", step,
                    f"no slot free ({self._slots.refusal})" if got is None
                    else "no slot free on another rank",
                )  # fmt: skip
                return False
            assert got is not None
            index, slot = got
            is_round = self._replication.agreed(step, agreed)
            # Odd generation from here on: a death before the copy completes leaves it torn.
            gen = slot.begin_write()
            self._copier.start(
                Copy(index, slot, step, gen, files, entries, data_end, metas[is_round], persist,
                     replica_round=is_round),
                background=self.async_copy,
            )  # fmt: skip
        s = self.stats
        s.saves += 1
        s.last_save_seconds = time.perf_counter() - t0
        s.last_save_bytes = sum(f.nbytes for f in files)
        return True

    def _everyone(self, ok: bool) -> bool:
        """True when `ok` holds on every rank (collective)."""
        return everyone(ok, self._group, self.world_size)

    def wait(self) -> None:
        """Waits until the last save's copy into shared memory is complete."""
        self._copier.wait()

    def wait_slots(self) -> None:
        """Waits until the last save's copy is complete and every slot is allocated (a fresh
        launch allocates the slots its first save does not use in the background after it)."""
        self.wait()
        self._slots.reserve_deferred()
        self._slots.settle()

    def _copied(self, c: Copy, seconds: float | None) -> None:
        """The copy of a save finished (seconds None: it failed); runs on the copying thread."""
        if seconds is None:
            self.stats.failed_copies += 1
            return
        self.stats.memory_step = c.step
        self.stats.last_copy_seconds = seconds
        if c.replica_round and self._client is not None:
            self._client.saved(c.step)  # the agent sends it to the node's holders now
        if c.persist and self._client is not None:
            self._slots.pin(c.index, c.step)
            self._client.persist(c.step, self.save_dir, self.job)
        elif c.persist:
            log.warning("diag: no control channel: step %d stays in memory only", c.step)

    def _capture(self, step: int, client_state: dict[str, Any]) -> list[CapturedFile]:
        return capture_checkpoint(
            self.engine, self.save_dir, step_tag(step), client_state,
            replica=self._replica, scripts=self._scripts,
        )  # fmt: skip

    # -- load ------------------------------------------------------------------------------------

    def load(self) -> int | None:
        """Restores the newest checkpoint every rank can load: from memory when all ranks hold it
        complete (and can read it), else from storage. Collective. Returns the step, or None
        with nothing to load."""
        self.wait()
        got = resume(self.engine, self._place(), self._group, self._slots, self._everyone)
        plan = got.plan
        self._replication.resumed(plan.step, plan.source == Source.MEMORY)
        if self._client is not None:
            self._client.resumed(ResumeNote(
                plan.source.value, -1 if plan.step is None else plan.step, plan.reason,
                got.fell_back, got.held, self._run,
            ))  # fmt: skip
        if plan.source != Source.NONE and plan.step is not None:
            self.client_state = got.client_state
            self.stats.loaded_from = plan.source.value
            if got.resharded_from is not None:
                self.stats.resharded_from = got.resharded_from
                self.stats.last_reshard_seconds = got.reshard_seconds
            self.stats.memory_step = plan.step if plan.source == Source.MEMORY else None
        return plan.step

    def _place(self) -> Place:
        return Place(self.run_dir, self.job, self.node, self.rank, self.world_size, self.save_dir,
                     self.agent_wait)  # fmt: skip

    # -- agent commands and acknowledgements -------------------------------------------------------

    def _on_command(self, cmd: Any) -> None:
        from diag.proto import control_pb2 as pb

        client = self._client
        assert client is not None
        if cmd.kind in (pb.COMMAND_KIND_FLUSH, pb.COMMAND_KIND_EXIT):
            kind = "flush" if cmd.kind == pb.COMMAND_KIND_FLUSH else "exit"
            self._box.put(Pending(cmd.id, kind, cmd.exit_code))
        else:
            client.report(cmd.id, False, detail=f"unknown command kind {cmd.kind}")

    def _on_ack(self, ack: Any) -> None:
        self._slots.unpin_step(ack.step)
        s = self.stats
        if ack.ok:
            s.persisted_step = max(s.persisted_step or -1, ack.step)
            s.last_persist_seconds = ack.seconds
            s.last_persist_bytes = ack.bytes
            if ack.committed:
                s.committed_step = max(s.committed_step or -1, ack.step)
        else:
            s.persist_failures += 1
            log.warning("diag: the agent could not persist step %d: %s", ack.step, ack.error)

    def _hook_step(self) -> None:
        add_step_hook(
            self.engine, StepHook("flash", before=self._before_step, after=self._after_step)
        )

    def _before_step(self, engine: Any) -> None:
        self.wait()  # the optimizer is about to change what the last save is copying

    def _after_step(self, engine: Any) -> None:
        # A fresh launch's other slots are allocated from here, off the first save's path: at the
        # end of this rank's copy the other ranks may still be copying theirs, and the
        # allocation would compete with them for the memory bandwidth (and here for the cores).
        self._slots.reserve_deferred()
        self.at_boundary()

    def at_boundary(self) -> None:
        """Honours FLUSH and EXIT at a step boundary (called after every engine.step)."""
        gs = int(getattr(self.engine, "global_steps", 0))
        if gs == self._boundary or self._client is None or self._closed or self._owner:
            return
        previous, self._boundary = self._boundary, gs
        if not self.period.advanced(previous, gs):
            return
        if not self.period.boundary(gs, time.monotonic()):
            return
        t0 = time.perf_counter()
        local = replace(self.vote(), every=self.period.proposal())
        agreed = agree(local, self._group, self.world_size)
        self.period.agreed(gs, agreed.every, time.perf_counter() - t0)
        self.act(agreed, gs)

    def delegate_boundary(self, owner: Any) -> None:
        """`owner` (a GracefulExit on the same engine) holds the agreements from now on, with
        this checkpointer's vote in them, so the ranks meet once per agreement, not twice."""
        self._owner = owner

    def vote(self) -> Agreement:
        """This rank's part of an agreement: the agent's pending commands, and whether an agent
        is there to persist a save to memory."""
        flags = self._box.local_flags()
        connected = self._client is not None and self._client.connected
        return replace(flags, no_agent=not connected)

    def report_pending(self, ok: bool, step: int, detail: str = "") -> None:
        """Tells the agent how its pending commands went (they were carried out at `step`)."""
        for p in self._box.take():
            if self._client is not None:
                self._client.report(p.command_id, ok, step=step, detail=detail)

    def act(self, agreed: Agreement, gs: int) -> None:
        """Carries out an agreement on FLUSH/EXIT at step `gs` (collective)."""
        if not (agreed.flush or agreed.exit):
            return
        ok = self.save(gs, persist=True)
        self.report_pending(ok, gs, "" if ok else "save skipped")
        if agreed.exit:
            self.exit_requested = True
            if self.exit_on_command:
                log.warning("diag: leaving after step %d on the agent's request", gs)
                self.close()
                raise SystemExit(agreed.exit_code)

    # -- the end -----------------------------------------------------------------------------------

    def close(self, remove: bool | None = None, *, for_restart: bool = False) -> None:
        """Ends this checkpointer. Its shared memory is removed unless a persist is still pending
        with a connected agent, which then persists and removes it. `for_restart`: an attempt
        that failed (recovery in place), its slots kept and marked as a failed exit's, so the
        agent keeps them for the next attempt even if this process dies before it."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        client = self._client
        pending = client.persist_pending() if client is not None else []
        if client is not None and pending:
            client.drain(CLOSE_DRAIN_TIMEOUT_S)
        if remove is None:
            # After a failure the snapshots stay: the agent persists them, a restart loads them.
            remove = not failwatch.failed() and not (
                pending and client is not None and client.connected
            )
        self._copier.pinned.release_all()
        self._slots.close(remove=remove, failed=for_restart or failwatch.failed())
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
