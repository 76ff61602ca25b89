"""The agent's end of the control channel: a gRPC server on a unix socket in the run directory.

Protobuf messages are turned into our own types here, at the edge; the manager never sees them
(except the outgoing AgentMessages it queues per rank).

Who may call: grpc's Python server does not tell a servicer who is at the other end of a unix
socket (`context.peer()` is "unix:", and the auth context of local credentials carries only
"transport_security_type": "local", no uid), so the server cannot check its clients' SO_PEERCRED
per call. It relies on the socket's mode instead: 0600, bound in a private directory and renamed
into place, so only the socket's owner and root can connect. The agent that serves it is the
ranks' user (or root, when they are root: agent.privilege), so the socket needs no chown. The ranks check the server's side
(diag.trainer.control.peer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import socket
import stat
import struct
import tempfile
from concurrent import futures
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import grpc

from diag.agent.checkpoint.manager import CheckpointManager
from diag.agent.checkpoint.ranknotes import RankNotes, Resume, bounded
from diag.agent.checkpoint.sessions import CommandReport, RankKey
from diag.formats.exitcodes import UsageError
from diag.formats.journalmeta import safe_job_name
from diag.formats.snapshot import read_latest_step
from diag.formats.untrusted import Owners
from diag.proto import control_pb2 as pb
from diag.proto import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_WORKERS = 64  # every connected rank holds one for its stream
_UNIX_PATH_MAX = 107
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _key(rid: Any) -> RankKey:
    return RankKey(safe_job_name(rid.job), rid.rank)


class ControlService(pb_grpc.ControlServicer):
    def __init__(self, manager: CheckpointManager, notes: RankNotes | None = None) -> None:
        self.manager = manager
        self.notes = notes or RankNotes("", manager.sessions)
        try:
            self.version = version("diag")
        except PackageNotFoundError:
            self.version = "unknown"

    def Register(self, request: Any, context: Any) -> Any:
        rid = request.id
        key = _key(rid)
        self.manager.sessions.register(
            key,
            request.pid,
            start_time=request.start_time,
            world_size=rid.world_size,
            node=rid.node,
            journal=request.journal,
            save_dir=request.save_dir,
        )
        # The caller is alive while it waits for this answer: the moment to make sure its PID
        # names it, and to start watching it.
        self.manager.watch_writer(key, request.pid, request.start_time, request.pid_ns)
        log.debug("rank %d of %s registered (pid %d)", rid.rank, rid.job, request.pid)
        self.notes.registered(key, rid.node)
        return pb.RegisterReply(
            agent_pid=os.getpid(), agent_version=self.version, node=self.notes.node
        )

    def Subscribe(self, request: Any, context: Any) -> Any:
        sessions = self.manager.sessions
        session = sessions.register(_key(request.id), request.pid)
        sessions.set_streaming(session, True)
        context.add_callback(lambda: sessions.set_streaming(session, False))
        replica = self.notes.replica_message()
        if replica is not None:
            yield replica  # replication's state first: the rank's next save votes on it
        try:
            while context.is_active():
                try:
                    msg = session.outbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if msg is None:
                    return
                yield msg
        finally:
            sessions.set_streaming(session, False)

    def Persist(self, request: Any, context: Any) -> Any:
        key = _key(request.id)
        ok, reason = self.manager.request_persist(key.job, key.rank, request.step, request.save_dir)
        return pb.PersistReply(accepted=ok, reason=reason)

    def Saved(self, request: Any, context: Any) -> Any:
        self.notes.saved(_key(request.id), request.step)
        return pb.SavedReply()

    def Resumed(self, request: Any, context: Any) -> Any:
        key = _key(request.id)
        self.notes.resumed(
            Resume(
                key.job, key.rank, bounded(request.source)[:16], max(-1, request.step),
                bounded(request.reason), request.memory_offered, bounded(request.held),
                bounded(request.run)[:256],
            )
        )  # fmt: skip
        return pb.ResumeReply()

    def Report(self, request: Any, context: Any) -> Any:
        self.manager.sessions.report(
            CommandReport(
                command_id=request.command_id,
                rank=request.id.rank,
                ok=request.ok,
                detail=request.detail,
                step=request.step,
                path=request.path,
            )
        )
        return pb.ReportReply()

    def Status(self, request: Any, context: Any) -> Any:
        job = safe_job_name(request.job)
        memory: dict[int, int] = {}
        save_dir = ""
        for s in self.manager.snapshots(job):
            memory[s.meta.rank] = max(memory.get(s.meta.rank, -1), s.meta.step)
            save_dir = save_dir or s.meta.save_dir
        stats = {r.rank: r for r in self.manager.stats().ranks if r.job == job}
        sessions = self.manager.sessions.of_job(job)
        save_dir = save_dir or next((s.save_dir for s in sessions.values() if s.save_dir), "")
        if self.manager.options.save_dir is not None:
            save_dir = str(self.manager.options.save_dir)
        committed = read_latest_step(save_dir) if save_dir else None
        ranks = []
        for rank in sorted(set(memory) | set(sessions)):
            st = stats.get(rank)
            s = sessions.get(rank)
            ranks.append(
                pb.RankStatus(
                    rank=rank,
                    pid=s.pid if s else 0,
                    connected=bool(s and s.streaming),
                    memory_step=memory.get(rank, -1),
                    persisted_step=st.persisted_step
                    if st and st.persisted_step is not None
                    else -1,
                )
            )
        return pb.StatusReply(
            ranks=ranks, committed_step=-1 if committed is None else committed, save_dir=save_dir
        )


class ControlServer:
    def __init__(
        self,
        path: Path,
        manager: CheckpointManager,
        *,
        owners: Owners | None = None,
        exclusive: bool = False,
        notes: RankNotes | None = None,
    ) -> None:
        self.path = path
        self.manager = manager
        self.notes = notes
        # The users whose agent may already serve this path: root, this process's user and the
        # run directory's owner unless told (the ranks' users, once the agent is given them).
        self.owners = owners or _default_owners(path, manager.run_dir)
        # The caller holds the lock of the run directory's agent (privilege.statedir): whatever
        # listens at the path now is not an agent of this run directory, whoever runs it.
        self.exclusive = exclusive
        self.server: Any = None

    def start(self) -> ControlServer:
        if len(str(self.path)) > _UNIX_PATH_MAX:
            raise UsageError(
                f"the control socket path {self.path} is longer than {_UNIX_PATH_MAX} bytes; "
                "use a shorter --run-dir or set --control-socket"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            parent = os.open(self.path.parent, _DIR_FLAGS)
        except OSError as e:
            raise UsageError(f"cannot open {self.path.parent}: {e.strerror}") from e
        try:
            self._clear(parent)
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="diag-grpc"),
                maximum_concurrent_rpcs=MAX_WORKERS * 2,
            )
            pb_grpc.add_ControlServicer_to_server(ControlService(self.manager, self.notes), server)
            _bind_private(server, parent, self.path)
        finally:
            os.close(parent)
        server.start()
        self.server = server
        log.info("control channel on %s", self.path)
        return self

    def _clear(self, parent: int) -> None:
        """Removes what is at the socket's name: left by an agent that died, or planted."""
        name = self.path.name
        try:
            os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as e:
            raise UsageError(f"cannot look at {self.path}: {e.strerror}") from e
        peer = _listener(self.path)
        if peer is not None and not self.exclusive and peer[1] in self.owners.uids:
            raise UsageError(
                f"another agent (pid {peer[0]}, uid {peer[1]}) already serves {self.path}; "
                "stop it, or give this one another --run-dir, --job or --control-socket"
            )
        if peer is not None:
            log.warning(
                "replacing %s: pid %d of uid %d listened there, which is not an agent of this "
                "run directory", self.path, peer[0], peer[1],
            )  # fmt: skip
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)

    def stop(self, grace: float = 1.0) -> None:
        if self.server is None:
            return
        self.server.stop(grace).wait(grace + 1)
        self.server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _bind_private(server: Any, parent: int, path: Path) -> None:
    """Binds the server to `path` (in the directory open as `parent`) so that it is never
    reachable with a looser mode than 0600, whatever the umask, and acts by descriptor only: the
    socket is bound in a fresh private directory reached through its descriptor (a directory
    renamed or swapped meanwhile changes nothing), made owner-only through a descriptor of its
    own, then renamed into place between descriptors."""
    private = Path(tempfile.mkdtemp(prefix=".c", dir=path.parent)).name
    try:
        fd = os.open(private, _DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        raise UsageError(f"cannot open a private directory beside {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise UsageError(f"the private directory made beside {path} was replaced meanwhile")
        # A name of its own: gRPC unlinks the path it bound when it stops, by then through
        # whatever directory has that descriptor number.
        name = f"s-{secrets.token_hex(8)}"
        if server.add_insecure_port(f"unix:/proc/self/fd/{fd}/{name}") == 0:
            raise UsageError(f"cannot serve the control channel on {path}")
        sock = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        try:
            sst = os.fstat(sock)
            if not stat.S_ISSOCK(sst.st_mode) or sst.st_uid != os.geteuid():
                raise UsageError(f"the socket bound for {path} was replaced meanwhile")
            os.chmod(f"/proc/self/fd/{sock}", 0o600)  # the socket's own inode, by descriptor
        finally:
            os.close(sock)
        os.replace(name, path.name, src_dir_fd=fd, dst_dir_fd=parent)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(private, dir_fd=parent)


def _default_owners(path: Path, run_dir: Path) -> Owners:
    uids = [os.geteuid()]
    for d in (run_dir, path.parent):
        with contextlib.suppress(OSError):
            uids.append(os.stat(d).st_uid)
    return Owners.of(*uids)


_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _listener(path: Path) -> tuple[int, int] | None:
    """(pid, uid) of the process listening at `path` (a symlink is not followed), None when
    nothing listens there."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(f"/proc/self/fd/{fd}")
            except OSError:
                return None
            pid, uid, _ = _CRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return pid, uid
    finally:
        os.close(fd)
