"""A hostile replica holder on 127.0.0.1: it speaks the replica wire protocol (frames made with
the agent's own wire module) but answers what it likes: any step, parts whose descriptions name
any save directory, bytes dribbled one at a time. It records every byte the agent sends it.

It proves the job's token only when it is given the token; without it, it answers the agent's
HELLO with a CHALLENGE whose proof is a guess. It also answers an agent of the protocol's first
version (a HELLO that carries the token itself and no nonce), so that a test of a finding fails
for the finding's own reason on the code from before its fix.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from snapshot_helpers import new_slot, write_raw_snapshot

from diag.agent.replica.wire import Kind, Manifest, Part, manifest_body, recv, send
from diag.formats.snapshot import slot_path

ATTACKER_KEY = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostileHolderKey attacker@evil\n"


@dataclass
class Offered:
    """The replica the fake holder offers: node `node`'s ranks of job `job` at `step`, each
    part's description naming `save_dir` and holding one raw file `file_name`."""

    node: str
    job: str
    step: int
    save_dir: Path
    ranks: tuple[int, ...] = (0,)
    world: int = 1
    run: str = "r1"
    file_name: str = "authorized_keys"
    payload: bytes = ATTACKER_KEY
    parts: list[tuple[Part, bytes]] = field(default_factory=list)

    def build(self, scratch: Path) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        for rank in self.ranks:
            slot = new_slot(scratch, self.job, rank, 0, world=self.world)
            write_raw_snapshot(slot, self.step, {self.file_name: self.payload}, job=self.job,
                               rank=rank, world=self.world, save_dir=self.save_dir,
                               node=self.node, run=self.run)  # fmt: skip
            h = slot.header()
            slot.close()
            used = h.meta_offset + h.meta_len
            data = slot_path(scratch, self.job, rank, 0).read_bytes()[:used]
            self.parts.append((Part(rank, 0, used), data))

    @property
    def manifest(self) -> Manifest:
        parts = tuple(p for p, _ in self.parts)
        return Manifest(self.node, self.job, self.step, self.run, self.world, parts)


class _Recorder:
    """A socket's reads, kept."""

    def __init__(self, sock: socket.socket, into: bytearray) -> None:
        self.sock = sock
        self.into = into

    def recv_into(self, buffer, nbytes: int = 0, /) -> int:
        n = self.sock.recv_into(buffer, nbytes)
        self.into += bytes(memoryview(buffer)[:n])
        return n


class FakeHolder:
    def __init__(
        self,
        name: str,
        offered: Offered,
        *,
        token: str | None = None,
        dribble_s: float = 0.0,
    ) -> None:
        self.name = name
        self.offered = offered
        self.token = token
        self.dribble_s = dribble_s  # > 0: after the manifest, one byte every this many seconds
        self.received = bytearray()  # everything agents sent
        self.served: list[str] = []  # the operations answered
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        with contextlib.suppress(OSError):
            self._listener.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        reader = _Recorder(conn, self.received)
        with contextlib.suppress(Exception), conn:
            _, body = recv(reader, Kind.HELLO, "agent")
            if "nonce" in body:  # the protocol with a challenge
                self._challenge(conn, reader, body)
            op = body.get("op")
            if op == "offer":
                o = self.offered
                send(conn, Kind.OFFER, {"step": o.step, "run": o.run, "world_size": o.world,
                                        "ranks": list(o.ranks)})  # fmt: skip
            elif op == "pull":
                send(conn, Kind.MANIFEST, manifest_body(self.offered.manifest))
                data = b"".join(d for _, d in self.offered.parts)
                if self.dribble_s > 0:
                    for i in range(len(data)):
                        if self._stop.wait(self.dribble_s):
                            return
                        conn.sendall(data[i : i + 1])
                else:
                    conn.sendall(data)
            self.served.append(str(op))
            conn.recv(1)  # until the agent is done with it

    def _challenge(self, conn: socket.socket, reader: _Recorder, body: dict) -> None:
        from diag.agent.replica.auth import NONCE_BYTES, Context, Role, proof
        from diag.agent.replica.wire import Challenge, challenge_body

        nonce = bytes.fromhex(body["nonce"])
        mine = secrets.token_bytes(NONCE_BYTES)
        ctx = Context(body["job"], body["node"], body["holder"], body["op"])
        if self.token is not None:
            claim = proof(self.token.encode(), Role.HOLDER, ctx, nonce, mine)
        else:
            claim = os.urandom(32)  # the best a holder without the token can do
        send(conn, Kind.CHALLENGE, challenge_body(Challenge(self.name, mine, claim)))
        recv(reader, Kind.AUTH, "agent")
