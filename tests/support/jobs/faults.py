"""SIGKILL at a chosen instant of a flash checkpoint's life, for the kill suite (killsuite.py).

The processes under test (trainer ranks, the agent) mark the phases they pass through:

    save       the trainer captures its state and takes a slot (FlashCheckpointer.save)
    copy       the trainer copies the captured state into its shared-memory slot (Copier._run)
    persist    the agent writes a rank's snapshot to storage, up to its done-marker (persist_slot)
    commit     the agent checks the markers and writes `latest` (storage.try_commit)
    replicate  the agent pushes the node's replica to one holder (agent.replica's push)
    receive    a holder's agent takes a peer's replica (agent.replica's store)

and tick at the sub-operations inside them (one storage copied, one file written, `latest`
renamed into place...). The harness publishes a plan in `<ctl>/plan.json`: a phase, the PIDs to
kill, a mode and a fraction. The first process that enters that phase claims the plan
(`claim-<id>`, O_EXCL) and fires:

- mode "tick": at the tick `fraction x (ticks this phase had last time)`, 0 being the phase's
  entry, synchronously on the thread running the phase (the instants between sub-operations);
- mode "timer": after `fraction x (the phase's last duration)` seconds, from a timer thread, if
  the phase is still running then (an instant in the middle of a write or a copy); a phase that
  ends first gives the claim back and the next occurrence tries again.

Firing writes `<ctl>/fired-<id>.json` (what was running at that instant), SIGKILLs the other
PIDs, then itself when it is one of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("save", "copy", "persist", "commit")
REPLICA_PHASES = (*PHASES, "replicate")  # with replicas in a peer
HOLDER_PHASES = ("receive",)  # in the holder's agent
PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class Plan:
    id: int
    phase: str
    pids: tuple[int, ...]
    mode: str  # "tick" or "timer"
    fraction: float  # in [0, 1): where in the phase

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        return cls(d["id"], d["phase"], tuple(d["pids"]), d["mode"], d["fraction"])


@dataclass(frozen=True)
class Fired:
    """What the firing process saw at the instant of the kill."""

    id: int
    planned: str
    phase: str  # the innermost phase of the firing thread at that instant ("" when none)
    mode: str
    role: str
    pid: int
    tick: int
    delay: float
    step: int
    at: float

    @classmethod
    def load(cls, path: Path) -> Fired:
        return cls(**json.loads(path.read_text()))


def write_json_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_native_id()}")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(eq=False)
class _Occurrence:
    phase: str
    stack: list[_Occurrence]
    step: int
    t0: float = field(default_factory=time.monotonic)
    ticks: int = 0
    plan: Plan | None = None
    fire_at: int = 0
    timer: threading.Timer | None = None
    delay: float = 0.0
    closed: bool = False


class Injector:
    def __init__(self, ctl: Path, role: str) -> None:
        self.ctl = ctl
        self.role = role
        self._lock = threading.Lock()
        self._local = threading.local()
        self._plan: Plan | None = None
        self._plan_mtime = 0
        self._ticks: dict[str, int] = {}
        self._seconds: dict[str, float] = {}

    # -- marking phases ------------------------------------------------------------------------

    def _stack(self) -> list[_Occurrence]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextlib.contextmanager
    def phase(self, name: str, step: int = -1) -> Iterator[None]:
        stack = self._stack()
        occ = _Occurrence(name, stack, step)
        stack.append(occ)
        plan = self._open_plan(name)
        if plan is not None:
            self._arm(occ, plan)
        try:
            yield
        finally:
            self._close(occ)
            with contextlib.suppress(ValueError):
                stack.remove(occ)

    def end(self, name: str) -> None:
        """Ends the innermost open `name` phase of this thread early (the persist phase ends
        where the commit begins)."""
        for occ in reversed(self._stack()):
            if occ.phase == name and not occ.closed:
                self._close(occ)
                return

    def tick(self) -> None:
        stack = self._stack()
        if not stack:
            return
        occ = stack[-1]
        if occ.closed:
            return
        occ.ticks += 1
        if occ.plan is not None and occ.plan.mode == "tick" and occ.ticks >= occ.fire_at:
            self._fire(occ, occ.plan)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` followed by a tick."""

        def ticked(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            self.tick()
            return result

        return ticked

    # -- plans -----------------------------------------------------------------------------------

    def _open_plan(self, phase: str) -> Plan | None:
        path = self.ctl / PLAN_FILE
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime != self._plan_mtime:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self._plan = Plan.from_json(path.read_text())
                self._plan_mtime = mtime
        plan = self._plan
        if plan is None or plan.phase != phase:
            return None
        if (self.ctl / f"fired-{plan.id}.json").exists():
            return None
        try:
            os.close(os.open(self.ctl / f"claim-{plan.id}", os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return None
        return plan

    def _unclaim(self, plan: Plan) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.ctl / f"claim-{plan.id}")

    def _arm(self, occ: _Occurrence, plan: Plan) -> None:
        occ.plan = plan
        if plan.mode == "tick":
            occ.fire_at = int(plan.fraction * (self._ticks.get(occ.phase, 2) + 1))
            if occ.fire_at == 0:
                self._fire(occ, plan)
            return
        occ.delay = plan.fraction * self._seconds.get(occ.phase, 0.005)
        occ.timer = threading.Timer(occ.delay, self._on_timer, (occ, plan))
        occ.timer.daemon = True
        occ.timer.start()

    def _on_timer(self, occ: _Occurrence, plan: Plan) -> None:
        with self._lock:
            if occ.closed or occ.plan is None:
                return
            self._fire(occ, plan)

    def _close(self, occ: _Occurrence) -> None:
        with self._lock:
            if occ.closed:
                return
            plan = occ.plan
            if plan is not None and plan.mode == "tick":
                self._fire(occ, plan)  # the phase had fewer ticks than last time: at its end
            occ.closed = True
            if plan is not None and plan.mode == "timer":
                occ.plan = None
                if occ.timer is not None:
                    occ.timer.cancel()
                self._unclaim(plan)  # ended before the timer: the next occurrence tries
            self._ticks[occ.phase] = occ.ticks
            self._seconds[occ.phase] = time.monotonic() - occ.t0

    def _fire(self, occ: _Occurrence, plan: Plan) -> None:
        inner = occ.stack[-1] if occ.stack else None
        fired = Fired(
            id=plan.id, planned=plan.phase, phase=inner.phase if inner else "",
            mode=plan.mode, role=self.role, pid=os.getpid(), tick=occ.ticks,
            delay=occ.delay, step=occ.step, at=time.time(),
        )  # fmt: skip
        write_json_atomic(self.ctl / f"fired-{plan.id}.json", json.dumps(asdict(fired)))
        me = os.getpid()
        for pid in plan.pids:
            if pid != me:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if me in plan.pids:
            os.kill(me, signal.SIGKILL)
        occ.plan = None


def install_trainer(inj: Injector) -> None:
    """Marks the trainer's phases: save (capture, layout, slot) and copy (into the slot)."""
    from diag.formats.slotfile import SlotFile
    from diag.trainer.flash import checkpointer as flash
    from diag.trainer.flash import copier, slots
    from diag.trainer.flash import slotlayout as layout

    save = flash.FlashCheckpointer.save

    def marked_save(self: Any, step: int, *args: Any, **kwargs: Any) -> bool:
        self.wait()  # the previous copy belongs to the copy phase
        with inj.phase("save", step):
            return save(self, step, *args, **kwargs)

    flash.FlashCheckpointer.save = marked_save  # type: ignore[method-assign]
    flash.capture_checkpoint = inj.wrap(flash.capture_checkpoint)
    layout.plan_layout = inj.wrap(layout.plan_layout)
    slots.RankSlots.acquire = inj.wrap(slots.RankSlots.acquire)  # type: ignore[method-assign]
    SlotFile.begin_write = inj.wrap(SlotFile.begin_write)  # type: ignore[method-assign]

    run = copier.Copier._run

    def marked_run(self: Any, c: Any) -> None:
        with inj.phase("copy", c.step):
            run(self, c)

    copier.Copier._run = marked_run  # type: ignore[method-assign]
    layout.copy_storage = inj.wrap(layout.copy_storage)
    SlotFile.finish_write = inj.wrap(SlotFile.finish_write)  # type: ignore[method-assign]


def install_agent(inj: Injector) -> None:
    """Marks the agent's phases: persist (files, fsyncs, marker), commit (`latest`), replicate
    (the authentication, the manifest, each rank's part sent) and receive (each part, the manifest)."""
    from diag.agent.checkpoint import persist, persister, storage
    from diag.agent.replica import replicator, store, transport

    persist_slot = persister.persist_slot

    def marked_persist(path: Path, **kwargs: Any) -> Any:
        with inj.phase("persist", kwargs.get("step") or -1):
            return persist_slot(path, **kwargs)

    persister.persist_slot = marked_persist
    persist._write_file = inj.wrap(persist._write_file)
    storage.fsync_dir = inj.wrap(storage.fsync_dir)
    storage.write_marker = inj.wrap(storage.write_marker)
    storage.write_bytes_atomic = inj.wrap(storage.write_bytes_atomic)
    try_commit = storage.try_commit

    def marked_commit(save_dir: Path, step: int, *args: Any, **kwargs: Any) -> bool:
        inj.end("persist")
        with inj.phase("commit", step):
            return try_commit(save_dir, step, *args, **kwargs)

    storage.try_commit = marked_commit

    push = replicator.push

    def marked_push(peers: Any, holder: str, local: Any, *args: Any, **kwargs: Any) -> Any:
        with inj.phase("replicate", local.manifest.step):
            return push(peers, holder, local, *args, **kwargs)

    replicator.push = marked_push
    transport.client_side = inj.wrap(transport.client_side)  # the authentication
    transport.send = inj.wrap(transport.send)
    transport.send_part = inj.wrap(transport.send_part)

    receive = store.ReplicaStore.receive

    def marked_receive(self: Any, m: Any, *args: Any, **kwargs: Any) -> Any:
        with inj.phase("receive", m.step):
            return receive(self, m, *args, **kwargs)

    store.ReplicaStore.receive = marked_receive  # type: ignore[method-assign]
    store.receive_part = inj.wrap(store.receive_part)
    store.write_replace = inj.wrap(store.write_replace)
