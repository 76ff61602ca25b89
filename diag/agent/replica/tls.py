"""TLS between agents, optional: Python's `ssl` over the same sockets, both ends with a
certificate of the job's CA.

The token's proofs (auth.py) say that the other end is an agent of the job; TLS adds what they
cannot: the bytes after the handshake (manifests, parts) can be neither read nor changed on the
way. Every agent presents a certificate (`--replica-tls-cert`, `--replica-tls-key`) and accepts
only one signed by the CA (`--replica-tls-ca`), as client and as server. Host names are not
checked: agents are reached at the addresses of --replica-nodes, which may be pod IPs, and which
node is at the other end is what the token's proof establishes.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    cert: Path  # this agent's certificate chain (PEM)
    key: Path  # its private key (PEM)
    ca: Path  # the CA (PEM) a peer's certificate must be signed by


def _context(purpose: ssl.Purpose, files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose, cafile=str(files.ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: a client without the CA's certificate too
    ctx.load_cert_chain(str(files.cert), str(files.key))
    return ctx


def server_context(files: TlsFiles) -> ssl.SSLContext:
    return _context(ssl.Purpose.CLIENT_AUTH, files)


def client_context(files: TlsFiles) -> ssl.SSLContext:
    return _context(ssl.Purpose.SERVER_AUTH, files)


@dataclass(frozen=True)
class Tls:
    """Both contexts, loaded once at start."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def load(cls, files: TlsFiles) -> Tls:
        return cls(server_context(files), client_context(files))
