"""Both ends of the authentication every replica connection starts with (the proofs: auth.py,
the frames: wire.py). The holder proves itself first; the client checks that proof before it
believes or sends anything more, then proves itself; the holder serves nothing before that."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable

from diag.agent.replica.auth import NONCE_BYTES, Context, Role, proof, proves
from diag.agent.replica.peers import Peers
from diag.agent.replica.wire import (
    Auth,
    Challenge,
    Hello,
    Kind,
    Op,
    auth_body,
    challenge_body,
    hello_body,
    parse_auth,
    parse_challenge,
    parse_hello,
    parse_result,
    recv,
    send,
)
from diag.formats.untrusted import UntrustedInput

WRONG_TOKEN = "check that DIAG_REPLICA_TOKEN is the same on every node of the job"


class NotAuthenticated(UntrustedInput):
    """The other end did not prove the job's token: not an agent of this job."""


def client_side(sock: socket.socket, peers: Peers, holder: str, op: Op, source: str) -> None:
    """Proves this node to `holder` once `holder` proved itself; UntrustedInput otherwise."""
    mine = secrets.token_bytes(NONCE_BYTES)
    send(sock, Kind.HELLO, hello_body(Hello(op, peers.me, peers.job, holder, mine)))
    kind, body = recv(sock, (Kind.CHALLENGE, Kind.RESULT), source)
    if kind == Kind.RESULT:
        raise UntrustedInput(source, f"refused: {parse_result(body, source).error}")
    challenge = parse_challenge(body, source)
    ctx = Context(peers.job, peers.me, holder, op.value)
    if challenge.holder != holder or not proves(
        peers.secret, Role.HOLDER, ctx, mine, challenge.nonce, challenge.proof
    ):
        raise NotAuthenticated(
            source, f"did not prove the job's replica token: not believed ({WRONG_TOKEN})"
        )
    theirs = challenge.nonce
    send(sock, Kind.AUTH, auth_body(Auth(proof(peers.secret, Role.CLIENT, ctx, mine, theirs))))


def holder_side(
    sock: socket.socket, peers: Peers, source: str, admit: Callable[[Hello], None]
) -> Hello:
    """Reads the client's HELLO, proves this holder, and checks the client's proof; the HELLO of
    a client that proved the token. `admit(hello)` refuses a stranger first (UntrustedInput)."""
    hello = parse_hello(recv(sock, Kind.HELLO, source)[1], source)
    if hello.holder != peers.me:
        raise UntrustedInput(source, f"meant node {hello.holder!r}; this is {peers.me!r}")
    admit(hello)
    mine = secrets.token_bytes(NONCE_BYTES)
    ctx = Context(peers.job, hello.node, peers.me, hello.op.value)
    own = proof(peers.secret, Role.HOLDER, ctx, hello.nonce, mine)
    send(sock, Kind.CHALLENGE, challenge_body(Challenge(peers.me, mine, own)))
    auth = parse_auth(recv(sock, Kind.AUTH, source)[1], source)
    if not proves(peers.secret, Role.CLIENT, ctx, hello.nonce, mine, auth.proof):
        raise UntrustedInput(
            source, f"presented a wrong proof of the replica token ({WRONG_TOKEN})"
        )
    return hello
