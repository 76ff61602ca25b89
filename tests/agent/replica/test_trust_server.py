"""The replica server against connections that do not play fair, over real TCP on 127.0.0.1:
slow-loris strangers do not keep real peers out (finding A6 of the security review); and TLS
between agents."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from polling import wait_for
from replica_helpers import CAP, JOB, OWNERS, raw_slots

from diag.agent.replica.ring import Ring
from diag.agent.replica.source import local_replica
from diag.agent.replica.store import ReplicaStore
from diag.agent.replica.transport import Peers, ReplicaServer, ask_offer, pull, push
from diag.agent.replica.wire import MAGIC
from diag.formats.untrusted import UntrustedInput


def test_slow_loris_strangers_do_not_keep_a_real_peer_out(ring2) -> None:
    """A6. 64 connections, none with the token, each sending a byte now and then, hold no
    place a real peer needs: the oldest are dropped, and the peer's offer is answered."""
    a, _, server = ring2
    loris = []
    try:
        for _ in range(64):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(MAGIC[:1])  # the start of a frame; the next byte would come in 20 s
            loris.append(s)
        time.sleep(0.3)  # the server has taken them all
        t0 = time.monotonic()
        assert ask_offer(a, "b", timeout=5).step is None
        assert time.monotonic() - t0 < 5
    finally:
        for s in loris:
            s.close()


def test_a_stranger_is_dropped_at_its_deadline_from_accept(tmp_path) -> None:
    """A6. A connection dribbling a byte every 0.1 s (a per-read timeout never fires) is cut at
    the authentication's deadline from accept."""
    from diag.agent.replica.admission import Limits

    ring = Ring.of(["a", "b"], 1)
    addrs = {"a": ("127.0.0.1", 0), "b": ("127.0.0.1", 0)}
    server = ReplicaServer(
        ReplicaStore(tmp_path / "b", CAP), Peers(ring, addrs, "b", JOB, "tok"), ("127.0.0.1", 0),
        limits=Limits(auth_deadline=0.5),
    ).start()  # fmt: skip
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            t0 = time.monotonic()
            header = b"DRPL\x02\x01" + b"\xff" * 6
            cut = None
            for byte in header:
                try:
                    s.sendall(bytes([byte]))
                except OSError:
                    cut = time.monotonic() - t0
                    break
                time.sleep(0.1)
            if cut is None:
                assert s.recv(1) == b""
                cut = time.monotonic() - t0
            assert cut < 3.0, cut
    finally:
        server.close()


def _certificate(where: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA), made with the openssl command."""
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_between_agents(tmp_path) -> None:
    """Two agents with certificates of the job's CA push and pull over TLS; a plain client, and
    one whose certificate another CA signed, get nothing."""
    from diag.agent.replica.tls import Tls, TlsFiles

    cert, key = _certificate(tmp_path, "job")
    tls = Tls.load(TlsFiles(cert, key, cert))
    ring = Ring.of(["a", "b"], 1)
    store = ReplicaStore(tmp_path / "b-replicas", CAP)
    addrs = {"a": ("127.0.0.1", 0), "b": ("127.0.0.1", 0)}
    server = ReplicaServer(store, Peers(ring, addrs, "b", JOB, "tok", tls), ("127.0.0.1", 0))
    server.start()
    try:
        addrs["b"] = ("127.0.0.1", server.port)
        a = Peers(ring, addrs, "a", JOB, "tok", tls)
        run_dir = tmp_path / "a-run"
        run_dir.mkdir()
        raw_slots(run_dir, tmp_path / "save", 3, ranks=2)
        local = local_replica(run_dir, JOB, "a", OWNERS)
        assert local is not None
        result = push(a, "b", local, OWNERS)
        assert result.ok, result.error
        m, _ = pull(a, "b", tmp_path / "fresh", max_bytes=CAP)
        assert m.step == 3

        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as plain:
            plain.sendall(b"DRPL" + b"\x00" * 8)  # no TLS: the server sees no client hello
            got = b""
            plain.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                while chunk := plain.recv(4096):
                    got += chunk
            assert MAGIC not in got

        other_cert, other_key = _certificate(tmp_path, "other")
        other = Peers(ring, addrs, "a", JOB, "tok", Tls.load(TlsFiles(other_cert, other_key,
                                                                       cert)))  # fmt: skip
        with pytest.raises((OSError, UntrustedInput)):
            ask_offer(other, "b")
        plain_peer = Peers(ring, addrs, "a", JOB, "tok")
        with pytest.raises((OSError, UntrustedInput)):
            ask_offer(plain_peer, "b")
        assert wait_for(lambda: store.held("a") is not None)
    finally:
        server.close()


@pytest.mark.parametrize("started", ["1", True, float("nan"), float("inf"), -1.0, 1e12, [1]])
def test_an_offer_with_a_start_time_that_is_not_one_is_refused(started: object) -> None:
    """When a peer's agent started decides whether its node was lost (job/silence.py): a value
    that is not a plausible time is refused, never taken as 'just started'."""
    from diag.agent.replica.wire import OfferReply as Reply
    from diag.agent.replica.wire import offer_body, parse_offer

    body = offer_body(Reply(7, "r1", 4, (2, 3), 1795874663.5))
    assert parse_offer(body, "peer").agent_started == 1795874663.5
    assert parse_offer({**body, "step": None}, "peer") == Reply(None, agent_started=1795874663.5)
    old = {k: v for k, v in body.items() if k != "agent_started"}  # an older agent's
    assert parse_offer(old, "peer").agent_started == 0.0
    with pytest.raises(UntrustedInput, match="agent_started"):
        parse_offer({**body, "agent_started": started}, "peer")
