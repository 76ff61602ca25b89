"""Who is at the other end of the control socket, checked before the trainer says or obeys anything.

Whoever can write the run directory could put their own socket (or a symlink to one) where the
agent's should be, and a rank would send it its identity and obey its FLUSH, EXIT and DUMP. So a
socket is believed only when:

- the path names a socket itself, not a symlink, owned by root, the trainer's own user or the
  agent's user (DIAG_AGENT_UID, for an agent that runs as yet another user);
- the process listening on it (SO_PEERCRED of a connection to it) runs as one of those users.

The socket's inode is held open (O_PATH) from the first check on, and gRPC connects through
/proc/self/fd/N, the very inode that was checked: replacing the file at the path afterwards
changes nothing for this connection. What stays open: a trusted user who hands its listening
socket to someone else; that user could do anything anyway.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

AGENT_UID_ENV = "DIAG_AGENT_UID"
MAX_UID = 2**32 - 2  # (uid_t)-1 means "no user"
PROBE_TIMEOUT_S = 3.0
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerConfigError(ValueError):
    """DIAG_AGENT_UID is set to something that is not a user id."""


@dataclass(frozen=True)
class PeerCred:
    pid: int  # 0 when the peer is in a PID namespace this process cannot see
    uid: int
    gid: int


class SocketRefused(Exception):
    """Something is at the socket's path that the trainer does not talk to."""

    def __init__(self, path: Path, problem: str, peer: PeerCred | None = None) -> None:
        self.path = path
        self.problem = problem
        self.peer = peer
        who = ""
        if peer is not None:
            who = f" (peer pid {peer.pid}, uid {peer.uid}, gid {peer.gid})"
        super().__init__(f"{path}: {problem}{who}")


def parse_uid(raw: str, name: str = AGENT_UID_ENV) -> int:
    """A user id written as decimal digits only (no sign, blanks inside or underscores)."""
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 10 or int(text) > MAX_UID:
        raise PeerConfigError(
            f"{name}={raw!r} is not a user id: set it to the agent's numeric uid "
            f"(0..{MAX_UID}) or unset it"
        )
    return int(text)


def trusted_uids(env: Mapping[str, str] = os.environ) -> frozenset[int]:
    """Root, this process's user and, when configured, the agent's user."""
    uids = {0, os.geteuid()}
    raw = env.get(AGENT_UID_ENV, "")
    if raw.strip():
        uids.add(parse_uid(raw))
    return frozenset(uids)


class PinnedSocket:
    """A checked socket inode, held open for as long as a channel uses it."""

    def __init__(self, path: Path, fd: int, peer: PeerCred) -> None:
        self.path = path
        self.fd = fd
        self.peer = peer

    @property
    def address(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    @property
    def target(self) -> str:
        return f"unix:{self.address}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pin_socket(path: Path, trusted: frozenset[int]) -> PinnedSocket | None:
    """The agent's socket at `path`, checked; None when nothing (or nothing listening) is there.
    Raises SocketRefused for a socket the trainer must not talk to."""
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fd = os.open(path.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SocketRefused(path, f"cannot open: {e.strerror}") from None
    finally:
        os.close(parent)
    try:
        peer = _check(path, fd, trusted)
    except BaseException:
        os.close(fd)
        raise
    if peer is None:
        os.close(fd)
        return None
    return PinnedSocket(path, fd, peer)


def _check(path: Path, fd: int, trusted: frozenset[int]) -> PeerCred | None:
    st = os.fstat(fd)
    if stat.S_ISLNK(st.st_mode):
        raise SocketRefused(path, "is a symlink; the agent's socket is never one")
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketRefused(path, "is not a socket")
    if st.st_uid not in trusted:
        raise SocketRefused(path, f"is owned by uid {st.st_uid}, {_allowed(trusted)}")
    peer = peer_of(f"/proc/self/fd/{fd}", path)
    if peer is not None and peer.uid not in trusted:
        raise SocketRefused(path, f"is served by uid {peer.uid}, {_allowed(trusted)}", peer)
    return peer


def peer_of(address: str, path: Path) -> PeerCred | None:
    """The credentials of the process listening at `address`; None when nobody listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(PROBE_TIMEOUT_S)
        try:
            s.connect(address)
        except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
            return None  # a socket left by an agent that died, or one too busy to answer
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None
            raise SocketRefused(path, f"cannot connect: {e.strerror}") from None
        raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
    pid, uid, gid = _CRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def _allowed(trusted: frozenset[int]) -> str:
    users = ", ".join(str(u) for u in sorted(trusted))
    return f"not a trusted user ({users}; set {AGENT_UID_ENV} for an agent of another user)"
