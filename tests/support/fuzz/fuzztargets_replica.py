"""Fuzz targets: the replica protocol between agents (agent.replica.wire), as a holder and a
restoring node read it from the other end of a connection.

- replica-wire-frames: a byte stream of frames (HELLO, CHALLENGE, AUTH, MANIFEST, OFFER,
  RESULT), read frame by frame as from a socket, each body parsed by its kind's parser;
- replica-wire-bodies: the frames' JSON bodies (structure-aware mutations), each parsed.
"""

from __future__ import annotations

import json
from pathlib import Path

from fuzzkit import FuzzTarget

from diag.agent.replica.wire import (
    FRAME,
    MAGIC,
    VERSION,
    Auth,
    Challenge,
    Hello,
    Kind,
    Manifest,
    OfferReply,
    Op,
    Part,
    Result,
    auth_body,
    challenge_body,
    hello_body,
    manifest_body,
    offer_body,
    parse_auth,
    parse_challenge,
    parse_hello,
    parse_manifest,
    parse_offer,
    parse_result,
    recv,
    result_body,
)
from diag.formats.untrusted import UntrustedInput

CAP = 64 << 20
SOURCE = "fuzzed peer"

_PARSERS = {
    Kind.HELLO: parse_hello,
    Kind.CHALLENGE: parse_challenge,
    Kind.AUTH: parse_auth,
    Kind.MANIFEST: lambda body, source: parse_manifest(body, source, max_part=CAP, max_total=CAP),
    Kind.OFFER: parse_offer,
    Kind.RESULT: parse_result,
}


class _Bytes:
    """What the wire reads frames from, in memory: a socket's recv_into over `data`."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.at = 0

    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int:
        n = min(nbytes or len(buffer), len(self.data) - self.at)
        buffer[:n] = self.data[self.at : self.at + n]
        self.at += n
        return n


def _bodies() -> dict[Kind, dict[str, object]]:
    m = Manifest("node-a", "train", 1200, "r1", 8, (Part(0, 0, 4096), Part(1, 1, 8192)))
    return {
        Kind.HELLO: hello_body(Hello(Op.PULL, "node-a", "train", "node-b", b"\x01" * 32)),
        Kind.CHALLENGE: challenge_body(Challenge("node-b", b"\x02" * 32, b"\x03" * 32)),
        Kind.AUTH: auth_body(Auth(b"\x04" * 32)),
        Kind.MANIFEST: manifest_body(m),
        Kind.OFFER: offer_body(OfferReply(1200, "r1", 8, (0, 1))),
        Kind.RESULT: result_body(Result(False, "no replica of node-a")),
    }


def _frame(kind: Kind, body: dict[str, object]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return FRAME.pack(MAGIC, VERSION, kind, len(data)) + data


def _frame_seeds(scratch: Path) -> list[bytes]:
    bodies = _bodies()
    session = b"".join(_frame(k, b) for k, b in bodies.items())
    nothing = _frame(Kind.OFFER, offer_body(OfferReply(None)))
    return [session, nothing, _frame(Kind.HELLO, bodies[Kind.HELLO])]


def parse_frames(path: Path) -> object:
    reader = _Bytes(path.read_bytes())
    out = []
    while reader.at < len(reader.data):
        kind, body = recv(reader, tuple(Kind), SOURCE)
        out.append(_PARSERS[kind](body, SOURCE))
    return out


def _body_seeds(scratch: Path) -> list[bytes]:
    return [json.dumps({k.name: b for k, b in _bodies().items()}).encode()]


def parse_bodies(path: Path) -> object:
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise UntrustedInput(SOURCE, f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise UntrustedInput(SOURCE, "not a JSON object")
    out = []
    for name, body in doc.items():
        kind = Kind.__members__.get(name)
        if kind is None or not isinstance(body, dict):
            raise UntrustedInput(SOURCE, f"{name!r} is not a frame kind with an object body")
        out.append(_PARSERS[kind](body, SOURCE))
    return out


TARGETS = [
    FuzzTarget("replica-wire-frames", _frame_seeds, parse_frames, file_name="frames.bin"),
    FuzzTarget("replica-wire-bodies", _body_seeds, parse_bodies, json=True, file_name="b.json"),
]
