"""The rank's end of the control channel: a gRPC client of the node's agent on a unix socket.

Training never waits for it. The client connects lazily in a background thread, registers,
and listens to the agent's stream of commands and persist acknowledgements; calls from the
training loop (persist requests, command reports) only enqueue. Every call has a timeout. Without
an agent the client warns once and keeps trying with backoff, so an agent that starts (or
restarts) later is found; pending persist requests are sent again after every reconnect.

Before it says anything, the client checks who serves the socket (diag.trainer.control.peer): a
socket that is a symlink, owned by or served by an untrusted user is treated as no agent at all,
with one warning. What the agent sends is checked before it is acted on
(diag.trainer.control.message); a DUMP writes only beneath the rank's own bases
(diag.trainer.control.selfdump).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diag.formats.rundir import control_socket_candidates
from diag.formats.untrusted import UntrustedInput
from diag.trainer.control import immediate
from diag.trainer.control.dumpbase import DumpBases
from diag.trainer.control.grpcthreads import channel_threads_since
from diag.trainer.control.identity import ClientIdentity, ResumeNote
from diag.trainer.control.message import (
    AgentCommand,
    PersistAck,
    RefusedCommand,
    ReplicaAck,
    hello_of,
    message_of,
)
from diag.trainer.control.outbox import CALL_TIMEOUT_S, deliver
from diag.trainer.control.peer import PeerCred, SocketRefused, pin_socket, trusted_uids

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0


CommandHandler = Callable[[AgentCommand], None]  # FLUSH and EXIT, checked
AckHandler = Callable[[PersistAck], None]
ReplicaHandler = Callable[[ReplicaAck], None]
ThreadHandler = Callable[[int], None]  # gets the native id of a thread diag started


class ControlClient:
    def __init__(
        self,
        run_dir: Path,
        ident: ClientIdentity,
        *,
        journal: str = "",
        socket_path: Path | None = None,
        dump_bases: DumpBases | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.trusted = trusted_uids()  # raises PeerConfigError for a bad DIAG_AGENT_UID
        self.dump_bases = dump_bases or DumpBases.resolve(run_dir)
        self.ident = ident
        self.journal = journal
        self.save_dir = ""
        self._explicit_socket = socket_path or _env_socket()
        self.on_command: CommandHandler | None = None
        self.on_ack: AckHandler | None = None
        self.on_replica: ReplicaHandler | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._outbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._pending_persist: dict[int, tuple[str, str]] = {}  # step -> (save dir, job)
        self._warned = False
        self._refused: set[str] = set()  # refusals warned about (once each)
        self._call: Any = None
        self._channel: Any = None
        self._stub: Any = None
        self._threads: list[threading.Thread] = []
        self._own: list[int] = []  # native ids of grpc threads started for this client
        self._on_own_thread: list[ThreadHandler] = []
        self.agent_pid: int | None = None
        self.agent_node = ""  # the node the agent says it is
        self._warned_node = ""
        self.peer: PeerCred | None = None  # who serves the socket, as the kernel says
        self.connects = 0

    # -- public, non-blocking ------------------------------------------------------------------

    def start(self) -> ControlClient:
        with self._lock:
            if self._threads:
                return self
            for target, name in ((self._listen, "diag-control"), (self._send, "diag-control-tx")):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)
        return self

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def own_threads(self) -> list[int]:
        """Native ids of the threads grpc started for this client (its channel pollers), whose
        stacks do not say they are diag's."""
        with self._lock:
            return list(self._own)

    def watch_own_threads(self, handler: ThreadHandler) -> None:
        """Calls `handler` with each such thread, those known now and those to come (a new
        one per connection)."""
        with self._lock:
            self._on_own_thread.append(handler)
            known = list(self._own)
        for tid in known:
            handler(tid)

    def _own_threads_started(self, before: set[int | None]) -> None:
        found = channel_threads_since(before)
        with self._lock:
            self._own.extend(found)
            handlers = list(self._on_own_thread)
        for tid in found:
            for handler in handlers:
                try:
                    handler(tid)
                except Exception:
                    log.exception("diag: recording the control channel's thread failed")

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    def set_save_dir(self, save_dir: str) -> None:
        self.save_dir = save_dir
        if self.connected:
            self._outbox.put(("register", None))

    def persist(self, step: int, save_dir: str, job: str | None = None) -> None:
        """Asks the agent to persist this rank's snapshot of `step` (of `job`, by default the
        client's); returns at once."""
        with self._lock:
            self._pending_persist[step] = (save_dir, job or self.ident.job)
        self._outbox.put(("persist", step))

    def persist_pending(self) -> list[int]:
        with self._lock:
            return sorted(self._pending_persist)

    def acknowledged(self, step: int) -> None:
        with self._lock:
            self._pending_persist.pop(step, None)

    def report(
        self, command_id: str, ok: bool, *, detail: str = "", step: int = -1, path: str = ""
    ) -> None:
        self._outbox.put(("report", (command_id, ok, detail, step, path)))

    def saved(self, step: int) -> None:
        """Tells the agent this rank completed its snapshot of `step`; returns at once."""
        self._outbox.put(("saved", step))

    def resumed(self, note: ResumeNote) -> None:
        """Tells the agent where this rank resumed from, and why; returns at once (sent when
        the agent is there, else dropped: the rank's own log says it too)."""
        self._outbox.put(("resumed", note))

    def drain(self, timeout: float) -> bool:
        """Waits until everything enqueued so far was sent (or dropped for want of an agent)."""
        done = threading.Event()
        self._outbox.put(("marker", done))
        return done.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._outbox.put(("stop", None))
        call, channel = self._call, self._channel
        if call is not None:
            call.cancel()
        if channel is not None:
            channel.close()

    # -- background ------------------------------------------------------------------------------

    def _socket(self) -> Path | None:
        if self._explicit_socket is not None:
            return self._explicit_socket if os.path.lexists(self._explicit_socket) else None
        for path in control_socket_candidates(self.run_dir, self.ident.job):
            if os.path.lexists(path):  # a symlink counts: it is refused, with a warning
                return path
        return None

    def rank_id(self, pb: Any, job: str | None = None) -> Any:
        i = self.ident
        return pb.RankId(
            job=job or i.job,
            rank=i.rank,
            world_size=i.world_size,
            local_rank=i.local_rank,
            attempt=i.attempt,
            node=i.node,
        )

    def _listen(self) -> None:
        import grpc

        from diag.proto import control_pb2 as pb
        from diag.proto import control_pb2_grpc as pb_grpc

        backoff = BACKOFF_MIN_S
        while not self._stop.is_set():
            path = self._socket()
            if path is None:
                self._warn_once(f"no diag agent socket in {self.run_dir}")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            try:
                pinned = pin_socket(path, self.trusted)
            except SocketRefused as e:
                self._refuse(e)
                pinned = None
            if pinned is None:
                self._warn_once(f"the diag agent at {path} does not answer")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            # Through the checked inode, never the path again; a pool of its own, so no
            # connection of an earlier channel to the same "/proc/self/fd/N" is reused.
            channel = grpc.insecure_channel(
                pinned.target, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            self._channel = channel
            source = f"the agent at {path}"
            try:
                stub = pb_grpc.ControlStub(channel)
                reply = stub.Register(self.register_request(pb), timeout=CALL_TIMEOUT_S)
                hello = hello_of(reply, source)
                self.agent_pid = hello.agent_pid
                self._check_node(hello.node, path)
                self.peer = pinned.peer
                self._stub = stub
                self.connects += 1
                self._connected.set()
                if self._warned:
                    log.warning("diag: connected to the agent at %s", path)
                self._warned = False
                backoff = BACKOFF_MIN_S
                self._outbox.put(("resend", None))
                before = {t.ident for t in threading.enumerate()}
                self._call = stub.Subscribe(
                    pb.SubscribeRequest(id=self.rank_id(pb), pid=self.ident.pid)
                )
                self._own_threads_started(before)
                for msg in self._call:
                    self._dispatch(msg, source)
            except UntrustedInput as e:
                log.warning("diag: %s; leaving the control channel", e)
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    self._warn_once(f"the diag agent at {path} does not answer ({_code(e)})")
            except Exception:
                log.exception("diag: control channel failed")
            finally:
                self._connected.clear()
                self._call = None
                channel.close()
                pinned.close()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def register_request(self, pb: Any) -> Any:
        i = self.ident
        return pb.RegisterRequest(
            id=self.rank_id(pb), pid=i.pid, journal=self.journal, save_dir=self.save_dir,
            start_time=i.start_time, pid_ns=i.pid_ns,
        )  # fmt: skip

    def _dispatch(self, msg: Any, source: str) -> None:
        try:
            item = message_of(msg, source)
        except RefusedCommand as e:
            log.warning("diag: refused a command from %s: %s", source, e.problem)
            self.report(e.command_id, False, detail=f"refused: {e.problem}")
            return
        except UntrustedInput as e:
            log.warning("diag: ignored a message from %s: %s", source, e.problem)
            return
        if isinstance(item, ReplicaAck):
            if self.on_replica is not None:
                try:
                    self.on_replica(item)
                except Exception:
                    log.exception("diag: handling a replica acknowledgement failed")
            return
        if isinstance(item, AgentCommand):
            if immediate.is_immediate(item):  # DUMP, RECOVER: no step boundary needed
                immediate.run(item, self.ident, self.dump_bases, self)
                return
            if self.on_command is None:
                self.report(item.id, False, detail="no handler for commands in this rank")
                return
            handler: Callable[[Any], None] = self.on_command
        else:
            self.acknowledged(item.step)
            if self.on_ack is None:
                return
            handler = self.on_ack
        try:
            handler(item)
        except Exception:
            log.exception("diag: handling %s from the agent failed", type(item).__name__)

    def _send(self) -> None:
        import grpc

        from diag.proto import control_pb2 as pb

        while True:
            kind, arg = self._outbox.get()
            if kind == "stop":
                return
            if kind == "marker":
                arg.set()
                continue
            if not self.connected:
                continue  # persist requests stay pending and are sent again after connecting
            try:
                deliver(self._stub, pb, kind, arg, self)
            except grpc.RpcError as e:
                log.debug("diag: control call %s failed: %s", kind, _code(e))

    # -- what the outbox's calls need (outbox.Sender) ------------------------------------------

    def pending(self) -> list[tuple[int, tuple[str, str]]]:
        with self._lock:
            return sorted(self._pending_persist.items())

    def _check_node(self, agent_node: str, path: Path) -> None:
        """Warns, once per name, when the agent is another node than this rank says it runs on:
        the agent replicates only its own node's snapshots, and a replaced node finds them only
        under the same name."""
        self.agent_node = agent_node
        mine = self.ident.node
        if not agent_node or agent_node == mine or self._warned_node == agent_node:
            return
        self._warned_node = agent_node
        log.error(
            "diag: this rank runs on node %r (DIAG_NODE, else NODE_NAME, else the host name), "
            "but the agent at %s is node %r: its snapshots will not be replicated to peers nor "
            "found again on a replaced node; give DIAG_NODE the same value in the trainer's and "
            "the agent's environment (the worker's place in the job, e.g. worker-0)",
            mine, path, agent_node,
        )  # fmt: skip

    def _refuse(self, e: SocketRefused) -> None:
        key = str(e)
        if key in self._refused:
            log.debug("diag: still not talking to %s", key)
            return
        self._refused.add(key)
        log.warning(
            "diag: not talking to the control socket %s; running as if no agent were there "
            "(flash checkpoints stay in memory, agent commands are off)",
            key,
        )

    def _warn_once(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "diag: %s; flash checkpoints stay in memory until an agent persists them, and "
                "agent commands are off (retrying in the background)",
                what,
            )


def _code(e: Any) -> str:
    try:
        return str(e.code().name)
    except Exception:
        return type(e).__name__


def _env_socket() -> Path | None:
    value = os.environ.get("DIAG_CONTROL_SOCKET", "")
    return Path(value) if value else None
