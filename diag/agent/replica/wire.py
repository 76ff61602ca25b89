"""The protocol between agents for replicas: length-prefixed frames over a TCP connection.

Every connection starts with the authentication (auth.py): the client's HELLO (who it is, the
job, the operation, the holder it means, its nonce), the holder's CHALLENGE (its nonce and its
proof of the job's token), and, once the client checked that proof, the client's AUTH (its own
proof). The token itself never crosses the wire. Then, by operation:

- push: the client sends a MANIFEST (node, job, step, launch, world size, and for each rank its
  slot index and byte count), then each part's bytes in the manifest's order, exactly as many as
  announced; the server answers with a RESULT.
- offer: the server answers with an OFFER (what it holds for the client's node, or nothing).
- pull: the server answers with a MANIFEST and the parts' bytes, or a RESULT saying why not.

A part is the used bytes of one rank's slot file: header, data and description, as the rank
wrote them (snapshot.py), so that the replica carries the same completeness markers as the slot.

Everything read from the other end is capped and parsed into our types here; anything out of
shape is an UntrustedInput naming the peer, and the connection is dropped.
"""

from __future__ import annotations

import enum
import json
import math
import socket
import struct
from dataclasses import dataclass
from typing import Protocol

from diag.agent.replica.auth import NONCE_BYTES, PROOF_BYTES
from diag.formats.snapshot import HEADER_SIZE
from diag.formats.untrusted import KIB, UntrustedInput, bounded_int

MAGIC = b"DRPL"
VERSION = 2  # 2: mutual authentication by nonces and HMAC (1 sent the token itself)
FRAME = struct.Struct("<4sBBI")  # magic, version, kind, payload length
MAX_FRAME = 256 * KIB  # a manifest of thousands of ranks stays far below
MAX_TEXT = 256  # node, job, launch
MAX_PARTS = 4096  # ranks of one node
MAX_SLOTS = 64
MAX_WORLD = 1 << 20
MAX_STEP = (1 << 63) - 1
MAX_WALL = 1e11  # seconds since the epoch: past the year 5000
CHUNK = 4 << 20


class Kind(enum.IntEnum):
    HELLO = 1
    MANIFEST = 2
    RESULT = 3
    OFFER = 4
    CHALLENGE = 5
    AUTH = 6


class Op(enum.Enum):
    PUSH = "push"
    OFFER = "offer"
    PULL = "pull"


@dataclass(frozen=True)
class Hello:
    op: Op
    node: str  # the node the client is (push, pull, offer: of its own replica)
    job: str
    holder: str  # the node the client means to reach: a proof for another holder is no use
    nonce: bytes  # NONCE_BYTES, fresh


@dataclass(frozen=True)
class Challenge:
    """The holder's answer to a HELLO: its nonce and its proof of the token."""

    holder: str
    nonce: bytes
    proof: bytes


@dataclass(frozen=True)
class Auth:
    """The client's proof of the token, sent once it believes the holder."""

    proof: bytes


@dataclass(frozen=True)
class Part:
    rank: int
    slot: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    node: str
    job: str
    step: int
    run: str
    world_size: int
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.parts)


@dataclass(frozen=True)
class Result:
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class OfferReply:
    """What a holder holds for the asking node: None fields when nothing."""

    step: int | None
    run: str = ""
    world_size: int = 0
    ranks: tuple[int, ...] = ()
    # When the answering agent started (its wall clock; 0: not said): a peer whose agent
    # started while this node's ranks ran was lost and came back (job/silence.py).
    agent_started: float = 0.0


# -- frames ----------------------------------------------------------------------------------------


def send(sock: socket.socket, kind: Kind, body: dict[str, object]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"a {kind.name} frame of {len(data)} bytes is over {MAX_FRAME}")
    sock.sendall(FRAME.pack(MAGIC, VERSION, kind, len(data)) + data)


class Readable(Protocol):
    """What frames are read from: a socket (or, for the fuzzer, bytes in memory)."""

    def recv_into(self, buffer: memoryview, nbytes: int = ..., /) -> int: ...


def recv_exact(sock: Readable, n: int, source: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise UntrustedInput(source, f"closed the connection {n - got} bytes short")
        got += k
    return bytes(buf)


def recv(sock: Readable, want: Kind | tuple[Kind, ...], source: str) -> tuple[Kind, dict]:
    """The next frame, of one of the kinds `want`, its body a JSON object."""
    wanted = (want,) if isinstance(want, Kind) else want
    magic, version, kind, length = FRAME.unpack(recv_exact(sock, FRAME.size, source))
    if magic != MAGIC:
        raise UntrustedInput(source, "does not speak diag's replica protocol (bad magic)")
    if version != VERSION:
        raise UntrustedInput(source, f"replica protocol version {version}, not {VERSION}")
    if kind not in {int(k) for k in wanted}:
        raise UntrustedInput(source, f"sent frame kind {kind} where {_names(wanted)} belongs")
    if length > MAX_FRAME:
        raise UntrustedInput(source, f"announced a frame of {length} bytes, over {MAX_FRAME}")
    try:
        body = json.loads(recv_exact(sock, length, source))
    except (ValueError, RecursionError) as e:
        raise UntrustedInput(source, f"sent a frame that is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise UntrustedInput(source, "sent a frame that is not a JSON object")
    return Kind(kind), body


def _names(kinds: tuple[Kind, ...]) -> str:
    return " or ".join(k.name for k in kinds)


# -- bodies ----------------------------------------------------------------------------------------


def _text(body: dict, key: str, source: str, *, empty: bool = False) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise UntrustedInput(source, f"{key} must be a string")
    if len(value) > MAX_TEXT or not value.isprintable() or (not value and not empty):
        raise UntrustedInput(source, f"{key} must be 1-{MAX_TEXT} printable characters")
    return value


def _bytes(body: dict, key: str, n: int, source: str) -> bytes:
    value = body.get(key)
    if not isinstance(value, str) or len(value) != 2 * n:
        raise UntrustedInput(source, f"{key} must be {n} bytes in hex")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise UntrustedInput(source, f"{key} must be {n} bytes in hex") from None


def hello_body(h: Hello) -> dict[str, object]:
    return {"op": h.op.value, "node": h.node, "job": h.job, "holder": h.holder,
            "nonce": h.nonce.hex()}  # fmt: skip


def parse_hello(body: dict, source: str) -> Hello:
    op = body.get("op")
    try:
        parsed = Op(op)
    except ValueError:
        raise UntrustedInput(source, f"asked for an unknown operation {str(op)[:40]!r}") from None
    return Hello(
        parsed,
        _text(body, "node", source),
        _text(body, "job", source),
        _text(body, "holder", source),
        _bytes(body, "nonce", NONCE_BYTES, source),
    )


def challenge_body(c: Challenge) -> dict[str, object]:
    return {"holder": c.holder, "nonce": c.nonce.hex(), "proof": c.proof.hex()}


def parse_challenge(body: dict, source: str) -> Challenge:
    return Challenge(
        _text(body, "holder", source),
        _bytes(body, "nonce", NONCE_BYTES, source),
        _bytes(body, "proof", PROOF_BYTES, source),
    )


def auth_body(a: Auth) -> dict[str, object]:
    return {"proof": a.proof.hex()}


def parse_auth(body: dict, source: str) -> Auth:
    return Auth(_bytes(body, "proof", PROOF_BYTES, source))


def manifest_body(m: Manifest) -> dict[str, object]:
    return {
        "node": m.node, "job": m.job, "step": m.step, "run": m.run, "world_size": m.world_size,
        "parts": [[p.rank, p.slot, p.nbytes] for p in m.parts],
    }  # fmt: skip


def parse_manifest(body: dict, source: str, *, max_part: int, max_total: int) -> Manifest:
    """A manifest whose parts are each at most `max_part` bytes and `max_total` in all, one part
    per rank, every rank inside the world."""
    world = bounded_int(
        body.get("world_size"), lo=1, hi=MAX_WORLD, what="world size", source=source
    )
    raw = body.get("parts")
    if not isinstance(raw, list) or not raw or len(raw) > min(MAX_PARTS, world):
        raise UntrustedInput(source, f"parts must be a list of 1 to {min(MAX_PARTS, world)}")
    parts = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 3:
            raise UntrustedInput(source, "a part must be [rank, slot, bytes]")
        rank = bounded_int(item[0], lo=0, hi=world - 1, what="rank", source=source)
        slot = bounded_int(item[1], lo=0, hi=MAX_SLOTS - 1, what="slot", source=source)
        nbytes = bounded_int(item[2], lo=HEADER_SIZE, hi=max_part, what="part size", source=source)
        parts.append(Part(rank, slot, nbytes))
    if len({p.rank for p in parts}) != len(parts):
        raise UntrustedInput(source, "a rank has two parts")
    m = Manifest(
        _text(body, "node", source),
        _text(body, "job", source),
        bounded_int(body.get("step"), lo=0, hi=MAX_STEP, what="step", source=source),
        _text(body, "run", source, empty=True),
        world,
        tuple(parts),
    )
    if m.nbytes > max_total:
        raise UntrustedInput(source, f"announced {m.nbytes} bytes, over the cap of {max_total}")
    return m


def result_body(r: Result) -> dict[str, object]:
    return {"ok": r.ok, "error": r.error[:1000]}


def parse_result(body: dict, source: str) -> Result:
    ok = body.get("ok")
    error = body.get("error", "")
    if not isinstance(ok, bool) or not isinstance(error, str):
        raise UntrustedInput(source, "a result must hold ok (bool) and error (string)")
    return Result(ok, error[:1000])


def offer_body(o: OfferReply) -> dict[str, object]:
    return {"step": o.step, "run": o.run, "world_size": o.world_size, "ranks": list(o.ranks),
            "agent_started": o.agent_started}  # fmt: skip


def parse_offer(body: dict, source: str) -> OfferReply:
    started = body.get("agent_started", 0.0)
    if isinstance(started, bool) or not isinstance(started, (int, float)):
        raise UntrustedInput(source, "agent_started must be a number")
    if not math.isfinite(started) or not 0 <= started < MAX_WALL:
        raise UntrustedInput(source, f"agent_started {started!r} is not a time")
    if body.get("step") is None:
        return OfferReply(None, agent_started=float(started))
    step = bounded_int(body.get("step"), lo=0, hi=MAX_STEP, what="step", source=source)
    world = bounded_int(
        body.get("world_size"), lo=1, hi=MAX_WORLD, what="world size", source=source
    )
    ranks = body.get("ranks")
    if not isinstance(ranks, list) or len(ranks) > min(MAX_PARTS, world):
        raise UntrustedInput(source, "ranks must be a list of ranks")
    parsed = tuple(bounded_int(r, lo=0, hi=world - 1, what="rank", source=source) for r in ranks)
    return OfferReply(step, _text(body, "run", source, empty=True), world, parsed, float(started))
