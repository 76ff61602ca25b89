"""How two agents prove to each other that they hold the job's replica token, without sending it.

Each side sends a fresh random nonce (the client in its HELLO, the holder in its CHALLENGE), and
each proves knowledge of the token with an HMAC-SHA256 keyed by it over both nonces and the
context of the connection: the protocol, who proves (client or holder), the job, the client's
node, the holder's node and the operation. So:
- the token never crosses the wire, and a proof seen once is worth nothing on another connection
  (the other side's nonce is new each time);
- a proof cannot be reflected: the client's and the holder's proofs differ in the role, and a
  proof made for one operation, job or pair of nodes does not verify for another;
- the holder proves itself first and the client believes nothing it sends before that proof.

Pure: bytes in, bytes or a verdict out; the nonces come from the caller (secrets.token_bytes).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

PROTOCOL = b"diag-replica/2"
NONCE_BYTES = 32
PROOF_BYTES = 32  # SHA-256
MIN_TOKEN_CHARS = 16  # a proof seen on the wire lets a weak token be guessed offline


class Role(enum.Enum):
    CLIENT = "client"
    HOLDER = "holder"


@dataclass(frozen=True)
class Context:
    """What a connection is for: both proofs are bound to all of it."""

    job: str
    client: str  # the node that connects
    holder: str  # the node it connects to
    op: str  # push, offer, pull


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data  # length-prefixed: no two contexts read alike


def proof(
    token: bytes, role: Role, ctx: Context, client_nonce: bytes, holder_nonce: bytes
) -> bytes:
    """The proof `role` gives on the connection `ctx` with these nonces."""
    message = b"".join(
        _field(x)
        for x in (
            PROTOCOL,
            role.value.encode(),
            ctx.job.encode(),
            ctx.client.encode(),
            ctx.holder.encode(),
            ctx.op.encode(),
            client_nonce,
            holder_nonce,
        )
    )
    return hmac.new(token, message, hashlib.sha256).digest()


def proves(
    token: bytes,
    role: Role,
    ctx: Context,
    client_nonce: bytes,
    holder_nonce: bytes,
    claimed: bytes,
) -> bool:
    """Whether `claimed` is the proof `role` owes on this connection (compared in constant time)."""
    want = proof(token, role, ctx, client_nonce, holder_nonce)
    return hmac.compare_digest(want, claimed)


def token_problem(token: str) -> str | None:
    """Why `token` cannot be the job's replica token (None: it can)."""
    if not token:
        return "is not set"
    if len(token) < MIN_TOKEN_CHARS:
        return f"has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}"
    if not token.isprintable():
        return "holds control characters"
    return None
