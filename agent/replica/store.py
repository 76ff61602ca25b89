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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
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
from diag.formats.journalmeta import safe_job_name
from diag.formats.shmroom import check_space
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import SnapshotError
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


class StoreBusy(RuntimeError):
    """A push for this peer is already arriving."""


@dataclass(frozen=True)
class Replica:
    manifest: Manifest
    path: Path
    seq: int  # when it was completed (ns): the newest of a node's replicas wins at a restart

    def part_path(self, part: Part) -> Path:
        return self.path / part_name(part)

    def offer(self) -> OfferReply:
        m = self.manifest
        return OfferReply(m.step, m.run, m.world_size, m.ranks)


def part_name(part: Part) -> str:
    return f"rank{part.rank:05d}.snap{part.slot}"


class ReplicaStore:
    def __init__(self, directory: Path, max_bytes: int, owners: Owners | None = None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes  # one peer's replica, all its ranks together
        self.owners = owners or Owners.this_process()
        self._held: dict[str, Replica] = {}
        self._lock = threading.Lock()
        self._arriving: set[str] = set()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._load()

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
            shutil.rmtree(old.path, ignore_errors=True)

    # -- receiving --------------------------------------------------------------------------------

    def receive(self, m: Manifest, sock: socket.socket, source: str) -> Replica:
        """Receives the parts `m` announces from `sock` and makes them `m.node`'s replica."""
        if m.nbytes > self.max_bytes:
            raise UntrustedInput(source, f"{m.nbytes} bytes, over the cap of {self.max_bytes}")
        with self._lock:
            if m.node in self._arriving:
                raise StoreBusy(f"a replica of {m.node} is already arriving")
            self._arriving.add(m.node)
        staging = self.directory / f"{STAGING_PREFIX}{safe_job_name(m.node)}-{secrets.token_hex(4)}"
        try:
            check_space(self.directory, m.nbytes)
            staging.mkdir(mode=0o700)
            d = open_dir(staging)
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
            final = self.directory / f"{safe_job_name(m.node)}-{m.step}-{secrets.token_hex(4)}"
            os.rename(staging, final)
            replica = Replica(m, final, seq)
            with self._lock:
                old = self._held.get(m.node)
                self._held[m.node] = replica
            if old is not None:
                shutil.rmtree(old.path, ignore_errors=True)
            return replica
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            with self._lock:
                self._arriving.discard(m.node)

    # -- at start ---------------------------------------------------------------------------------

    def _load(self) -> None:
        """Takes back the replicas a previous agent completed; removes what it left half done."""
        found: dict[str, Replica] = {}
        losers: list[Path] = []
        for entry in sorted(self.directory.iterdir()):
            if entry.is_symlink() or not entry.is_dir():
                continue
            replica = None
            if not entry.name.startswith(STAGING_PREFIX):
                try:
                    replica = self._read(entry)
                except (OSError, ValueError, SnapshotError, UntrustedInput) as e:
                    log.warning("removing the replica in %s: %s", entry, e)
            if replica is None:
                losers.append(entry)
                continue
            other = found.get(replica.manifest.node)
            if other is None or other.seq < replica.seq:
                if other is not None:
                    losers.append(other.path)
                found[replica.manifest.node] = replica
            else:
                losers.append(entry)
        for p in losers:
            shutil.rmtree(p, ignore_errors=True)
        self._held = found

    def _read(self, path: Path) -> Replica:
        source = str(path / MANIFEST_FILE)
        body = read_json(path / MANIFEST_FILE, max_bytes=256 * KIB, owners=self.owners)
        if not isinstance(body, dict) or not isinstance(body.get("manifest"), dict):
            raise UntrustedInput(source, "not a replica manifest")
        m = parse_manifest(
            body["manifest"], source, max_part=self.max_bytes, max_total=self.max_bytes
        )
        seq = body.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise UntrustedInput(source, "seq must be an integer")
        for part in m.parts:
            slot = SlotFile.open(path / part_name(part), owners=self.owners)
            try:
                check_header(slot.header(), part, m, str(path / part_name(part)))
            finally:
                slot.close()
        return Replica(m, path, seq)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            for entry in self.directory.iterdir():
                if entry.name.startswith(STAGING_PREFIX):
                    shutil.rmtree(entry, ignore_errors=True)
