"""The replicas a node holds for its peers: one per peer, in a memory-backed directory.

    <replica dir>/<node>-<step>-<nonce>/rank<rank:05d>.snap<slot>   one part per rank
    <replica dir>/<node>-<step>-<nonce>/replica.json                the manifest, written last

A push is received into a staging directory (`.in-...`); each part gets its slot's completeness
marker only once checked (parts.py), the manifest only once every part is in, and the directory its
name only then: a replica is whole or absent. The previous replica of that peer is removed once the
new one is in place, so a peer costs at most its cap twice, and only while a push is arriving.

The files live in the replica directory (default: `.replicas` in the run directory, shared memory)
rather than in the agent's heap, so an agent restart finds them again; a staging directory or one
without a manifest is what a dead agent left and is removed at start.

The replica directory may sit in a directory the trainer writes (the run directory), so it is
opened once, without following a symlink, and must be the agent's own and closed to everyone else
(`store_dir_refusal`); every create, rename and delete after that is relative to that descriptor,
and only entries named as the store names its own are ever deleted: a planted link or a foreign
directory is left alone, never followed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from diag.agent.replica.parts import check_header, new_part_file, receive_part
from diag.agent.replica.wire import (
    Manifest,
    OfferReply,
    Part,
    manifest_body,
    parse_manifest,
)
from diag.formats.exitcodes import UsageError
from diag.formats.journalmeta import safe_job_name
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import ShmSpaceError, SnapshotError
from diag.formats.untrusted import (
    KIB,
    Owners,
    UntrustedInput,
    open_dir,
    read_json,
    write_replace,
)

log = logging.getLogger(__name__)

MANIFEST_FILE = "replica.json"
STAGING_PREFIX = ".in-"
# The names the store gives (safe_job_name never starts a name with a dot): only these are ever
# removed, in the replica directory and inside one replica.
_REPLICA = re.compile(r"^[A-Za-z0-9_.-]{1,64}-[0-9]{1,19}-[0-9a-f]{8}$")
_STAGING = re.compile(r"^\.in-[A-Za-z0-9_.-]{1,64}-[0-9a-f]{8}$")
_MEMBER = re.compile(
    r"^(rank[0-9]{5}\.snap[0-9]{1,2}|replica\.json|\.replica\.json\.[0-9a-f]{12}\.tmp)$"
)
_PROC_FD = Path("/proc/self/fd")


class StoreBusy(RuntimeError):
    """A push for this peer is already arriving."""


@dataclass(frozen=True)
class Replica:
    manifest: Manifest
    path: Path  # its directory, reached through the store's descriptor where /proc allows
    seq: int  # when it was completed (ns): the newest of a node's replicas wins at a restart

    def part_path(self, part: Part) -> Path:
        return self.path / part_name(part)

    def offer(self) -> OfferReply:
        m = self.manifest
        return OfferReply(m.step, m.run, m.world_size, m.ranks)


def part_name(part: Part) -> str:
    return f"rank{part.rank:05d}.snap{part.slot}"


def ours(name: str) -> bool:
    """A name the store gives to a replica or a staging directory."""
    return bool(_REPLICA.match(name) or _STAGING.match(name))


def store_dir_refusal(*, is_dir: bool, uid: int, mode: int, euid: int) -> str | None:
    """Why a replica directory may not be used (None: it may): it must be a directory of the
    agent's own user that nobody else may enter, since the agent deletes beneath it."""
    if not is_dir:
        return "is not a directory"
    if uid != euid:
        return f"is owned by uid {uid}, not by the agent's user (uid {euid})"
    if mode & 0o077:
        return f"has mode {mode & 0o777:04o}: group and others must have no access (0700)"
    return None


def open_store_dir(directory: Path) -> int:
    """The replica directory, open (made 0700 when missing); UsageError when it is a symlink or
    not the agent's own private directory."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(directory, flags)
    except OSError as e:
        problem = (
            "is a symlink or not a directory" if e.errno in (errno.ELOOP, errno.ENOTDIR)
            else e.strerror
        )  # fmt: skip
        raise UsageError(
            f"the replica directory {directory} {problem}: remove it (the agent makes it) or "
            "set --replica-dir to a directory of the agent's own"
        ) from None
    st = os.fstat(fd)
    problem = store_dir_refusal(
        is_dir=stat.S_ISDIR(st.st_mode), uid=st.st_uid, mode=st.st_mode, euid=os.geteuid()
    )
    if problem is not None:
        os.close(fd)
        raise UsageError(
            f"the replica directory {directory} {problem}; the agent deletes beneath it, so it "
            "must be a directory only the agent's user can enter: remove it (the agent makes it "
            "0700) or set --replica-dir"
        )
    return fd


class ReplicaStore:
    def __init__(self, directory: Path, max_bytes: int, owners: Owners | None = None) -> None:
        self.directory = directory  # for messages; every access goes through self._fd
        self.max_bytes = max_bytes  # one peer's replica, all its ranks together
        self.owners = owners or Owners.this_process()
        self._held: dict[str, Replica] = {}
        self._lock = threading.Lock()
        self._arriving: set[str] = set()
        self._fd = open_store_dir(directory)
        proc = _PROC_FD / str(self._fd)
        self._root = proc if proc.is_dir() else directory  # the opened directory, whatever moves
        try:
            self._load()
        except BaseException:
            os.close(self._fd)
            raise

    # -- what is held -----------------------------------------------------------------------------

    def held(self, node: str) -> Replica | None:
        with self._lock:
            return self._held.get(node)

    def nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def bytes_held(self) -> int:
        with self._lock:
            return sum(r.manifest.nbytes for r in self._held.values())

    def drop(self, node: str) -> None:
        with self._lock:
            old = self._held.pop(node, None)
        if old is not None:
            self._remove(old.path.name)

    # -- receiving --------------------------------------------------------------------------------

    def receive(self, m: Manifest, sock: socket.socket, source: str) -> Replica:
        """Receives the parts `m` announces from `sock` and makes them `m.node`'s replica."""
        if m.nbytes > self.max_bytes:
            raise UntrustedInput(source, f"{m.nbytes} bytes, over the cap of {self.max_bytes}")
        with self._lock:
            if m.node in self._arriving:
                raise StoreBusy(f"a replica of {m.node} is already arriving")
            self._arriving.add(m.node)
        staging = f"{STAGING_PREFIX}{safe_job_name(m.node)}-{secrets.token_hex(4)}"
        try:
            self._check_space(m.nbytes)
            os.mkdir(staging, 0o700, dir_fd=self._fd)
            d = open_dir(staging, dir_fd=self._fd)
            try:
                for part in m.parts:
                    fd = new_part_file(part_name(part), dir_fd=d)
                    try:
                        receive_part(sock, fd, part, m, source, where=self.directory)
                    finally:
                        os.close(fd)
                seq = time.time_ns()
                body = {"manifest": manifest_body(m), "seq": seq}
                write_replace(d, MANIFEST_FILE, json.dumps(body).encode(), mode=0o600)
            finally:
                os.close(d)
            final = f"{safe_job_name(m.node)}-{m.step}-{secrets.token_hex(4)}"
            os.rename(staging, final, src_dir_fd=self._fd, dst_dir_fd=self._fd)
            replica = Replica(m, self._root / final, seq)
            with self._lock:
                old = self._held.get(m.node)
                self._held[m.node] = replica
            if old is not None:
                self._remove(old.path.name)
            return replica
        except BaseException:
            self._remove(staging)
            raise
        finally:
            with self._lock:
                self._arriving.discard(m.node)

    def _check_space(self, needed: int) -> None:
        st = os.fstatvfs(self._fd)
        free = st.f_bavail * st.f_frsize
        if needed > free:
            raise ShmSpaceError(
                f"a replica of {needed / 2**30:.2f} GiB does not fit in {self.directory}: "
                f"{free / 2**30:.2f} GiB is free; give it more room or lower --replica-max-bytes"
            )

    # -- removing, by descriptor ------------------------------------------------------------------

    def _remove(self, name: str) -> None:
        """Removes the store's own directory `name` and the files the store put in it; never
        follows a link, never touches a name the store does not give."""
        if not ours(name):
            return
        try:
            d = open_dir(name, dir_fd=self._fd)
        except FileNotFoundError:
            return
        except (OSError, UntrustedInput) as e:
            log.warning("left %s in %s alone: %s", name, self.directory, e)
            return
        try:
            with os.scandir(d) as entries:
                names = [e.name for e in entries if _MEMBER.match(e.name)]
            for member in names:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(member, dir_fd=d)
        finally:
            os.close(d)
        try:
            os.rmdir(name, dir_fd=self._fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("left %s in %s: %s (it holds files the agent did not make)",
                        name, self.directory, e.strerror)  # fmt: skip

    # -- at start ---------------------------------------------------------------------------------

    def _load(self) -> None:
        """Takes back the replicas a previous agent completed; removes what it left half done."""
        found: dict[str, Replica] = {}
        losers: list[str] = []
        with os.scandir(self._fd) as entries:
            names = sorted(
                e.name for e in entries if ours(e.name) and e.is_dir(follow_symlinks=False)
            )
        for name in names:
            replica = None
            if not name.startswith(STAGING_PREFIX):
                try:
                    replica = self._read(name)
                except (OSError, ValueError, SnapshotError, UntrustedInput) as e:
                    log.warning("removing the replica in %s: %s", self.directory / name, e)
            if replica is None:
                losers.append(name)
                continue
            other = found.get(replica.manifest.node)
            if other is None or other.seq < replica.seq:
                if other is not None:
                    losers.append(other.path.name)
                found[replica.manifest.node] = replica
            else:
                losers.append(name)
        for name in losers:
            self._remove(name)
        self._held = found

    def _read(self, name: str) -> Replica:
        source = str(self.directory / name / MANIFEST_FILE)
        d = open_dir(name, dir_fd=self._fd)
        try:
            body = read_json(MANIFEST_FILE, max_bytes=256 * KIB, owners=self.owners, dir_fd=d)
        finally:
            os.close(d)
        if not isinstance(body, dict) or not isinstance(body.get("manifest"), dict):
            raise UntrustedInput(source, "not a replica manifest")
        m = parse_manifest(
            body["manifest"], source, max_part=self.max_bytes, max_total=self.max_bytes
        )
        seq = body.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise UntrustedInput(source, "seq must be an integer")
        path = self._root / name
        for part in m.parts:
            slot = SlotFile.open(path / part_name(part), owners=self.owners)
            try:
                check_header(slot.header(), part, m, str(self.directory / name / part_name(part)))
            finally:
                slot.close()
        return Replica(m, path, seq)

    def close(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError), os.scandir(self._fd) as entries:
            staging = [e.name for e in entries if _STAGING.match(e.name)]
        for name in staging:
            self._remove(name)
        os.close(self._fd)
        self._fd = -1
