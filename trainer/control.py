"""The rank's end of the control channel: a gRPC client of the node's agent on a unix socket.

Training never waits for it. The client connects lazily in a background thread, registers,
and listens to the agent's stream of commands and persist acknowledgements; calls from the
training loop (persist requests, command reports) only enqueue. Every call has a timeout. Without
an agent the client warns once and keeps trying with backoff, so an agent that starts (or
restarts) later is found; pending persist requests are sent again after every reconnect.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.collector.rundir import control_socket_candidates

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 3.0
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
CONTROL_ENV = "DIAG_CONTROL"  # "0" disables the client
_DUMP = 3  # control_pb2.COMMAND_KIND_DUMP, without importing protobuf at start-up


@dataclass(frozen=True)
class ClientIdentity:
    job: str
    rank: int
    world_size: int
    local_rank: int
    attempt: int
    node: str
    pid: int
    start_time: float = 0.0  # the process's create time: with the PID, the agent watches it
    pid_ns: int = 0  # inode of the process's PID namespace (collector.rundir.pid_namespace)


CommandHandler = Callable[[Any], None]  # gets a diag.proto.control_pb2.Command
AckHandler = Callable[[Any], None]  # gets a diag.proto.control_pb2.PersistAck
ThreadHandler = Callable[[int], None]  # gets the native id of a thread diag started
_SPIN_FILE = os.path.join("grpc", "_channel.py")
_SPIN_FUNC = "channel_spin"
SPIN_WAIT_S = 1.0


def channel_threads_since(before: set[int | None], wait_s: float = SPIN_WAIT_S) -> list[int]:
    """Native ids of the threads started since `before` (thread idents) that run grpc's
    channel poller (`_run_channel_spin_thread`). A streaming call starts one for its channel; it
    runs only grpc's frames, so nothing in a stack dump says it is diag's: the journal meta
    does. Waits up to `wait_s` for a new thread to reach the poller."""
    deadline = time.monotonic() + wait_s
    while True:
        fresh = [t for t in threading.enumerate() if t.ident not in before]
        frames = sys._current_frames()
        found = []
        for t in fresh:
            f = frames.get(t.ident)  # type: ignore[arg-type]
            while f is not None:
                code = f.f_code
                if code.co_name == _SPIN_FUNC and code.co_filename.endswith(_SPIN_FILE):
                    if t.native_id:
                        found.append(t.native_id)
                    break
                f = f.f_back
        if found or not fresh or time.monotonic() >= deadline:
            return found
        time.sleep(0.01)


class ControlClient:
    def __init__(
        self,
        run_dir: Path,
        ident: ClientIdentity,
        *,
        journal: str = "",
        socket_path: Path | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.ident = ident
        self.journal = journal
        self.save_dir = ""
        self._explicit_socket = socket_path or _env_socket()
        self.on_command: CommandHandler | None = None
        self.on_ack: AckHandler | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._outbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._pending_persist: dict[int, tuple[str, str]] = {}  # step -> (save dir, job)
        self._warned = False
        self._call: Any = None
        self._channel: Any = None
        self._stub: Any = None
        self._threads: list[threading.Thread] = []
        self._own: list[int] = []  # native ids of grpc threads started for this client
        self._on_own_thread: list[ThreadHandler] = []
        self.agent_pid: int | None = None
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
            return self._explicit_socket if self._explicit_socket.exists() else None
        for path in control_socket_candidates(self.run_dir, self.ident.job):
            if path.exists():
                return path
        return None

    def _rank_id(self, pb: Any, job: str | None = None) -> Any:
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
            channel = grpc.insecure_channel(f"unix:{path}")
            self._channel = channel
            try:
                stub = pb_grpc.ControlStub(channel)
                reply = stub.Register(self._register_request(pb), timeout=CALL_TIMEOUT_S)
                self.agent_pid = reply.agent_pid
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
                    pb.SubscribeRequest(id=self._rank_id(pb), pid=self.ident.pid)
                )
                self._own_threads_started(before)
                for msg in self._call:
                    self._dispatch(msg)
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    self._warn_once(f"the diag agent at {path} does not answer ({_code(e)})")
            except Exception:
                log.exception("diag: control channel failed")
            finally:
                self._connected.clear()
                self._call = None
                channel.close()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _register_request(self, pb: Any) -> Any:
        i = self.ident
        return pb.RegisterRequest(
            id=self._rank_id(pb), pid=i.pid, journal=self.journal, save_dir=self.save_dir,
            start_time=i.start_time, pid_ns=i.pid_ns,
        )  # fmt: skip

    def _dispatch(self, msg: Any) -> None:
        which = msg.WhichOneof("body")
        if which == "command" and msg.command.kind == _DUMP:
            self._dump(msg.command)
            return
        handler = self.on_command if which == "command" else self.on_ack
        if which == "persist_ack":
            self.acknowledged(msg.persist_ack.step)
        if handler is None:
            if which == "command":
                self.report(msg.command.id, False, detail="no handler for commands in this rank")
            return
        try:
            handler(msg.command if which == "command" else msg.persist_ack)
        except Exception:
            log.exception("diag: handling %s from the agent failed", which)

    def _dump(self, cmd: Any) -> None:
        """DUMP needs no step boundary: it runs here, on the control thread, while the training
        thread may be stuck in a collective (it cannot run while another thread holds the GIL)."""
        from diag.trainer.selfdump import write_own_dump

        i = self.ident
        try:
            path = write_own_dump(
                Path(cmd.dump_dir), rank=i.rank, world_size=i.world_size,
                local_rank=i.local_rank, node=i.node,
            )  # fmt: skip
            self.report(cmd.id, True, path=str(path))
        except OSError as e:
            self.report(cmd.id, False, detail=f"cannot write the dump: {e}")

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
            stub = self._stub
            try:
                if kind == "register":
                    stub.Register(self._register_request(pb), timeout=CALL_TIMEOUT_S)
                elif kind in ("persist", "resend"):
                    with self._lock:
                        todo = sorted(self._pending_persist.items())
                    if kind == "persist":
                        todo = [(s, d) for s, d in todo if s == arg]
                    for step, (save_dir, job) in todo:
                        reply = stub.Persist(
                            pb.PersistRequest(
                                id=self._rank_id(pb, job), step=step, save_dir=save_dir
                            ),
                            timeout=CALL_TIMEOUT_S,
                        )
                        if not reply.accepted:
                            log.warning("diag: agent refused to persist step %d: %s", step,
                                        reply.reason)  # fmt: skip
                            self.acknowledged(step)
                elif kind == "report":
                    command_id, ok, detail, step, path = arg
                    stub.Report(
                        pb.CommandReport(
                            id=self._rank_id(pb),
                            command_id=command_id,
                            ok=ok,
                            detail=detail,
                            step=step,
                            path=path,
                        ),
                        timeout=CALL_TIMEOUT_S,
                    )
            except grpc.RpcError as e:
                log.debug("diag: control call %s failed: %s", kind, _code(e))

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


def enabled() -> bool:
    return os.environ.get(CONTROL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_client: ControlClient | None = None
_client_lock = threading.Lock()


def shared_client(
    run_dir: Path, ident: ClientIdentity, *, journal: str = ""
) -> ControlClient | None:
    """The process's one control client (started on first use), or None when disabled."""
    global _client
    if not enabled():
        return None
    with _client_lock:
        if _client is None:
            _client = ControlClient(run_dir, ident, journal=journal).start()
        elif journal and not _client.journal:
            _client.journal = journal
        return _client
