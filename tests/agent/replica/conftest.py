"""Fixtures of the replica tests."""

from __future__ import annotations

import pytest
from replica_helpers import CAP, JOB

from diag.agent.replica.ring import Ring
from diag.agent.replica.store import ReplicaStore
from diag.agent.replica.transport import Peers, ReplicaServer


@pytest.fixture
def ring2(tmp_path):
    """Node a and its holder b: b's replica server on a free port, and a's view of the ring."""
    store = ReplicaStore(tmp_path / "b-replicas", CAP)
    ring = Ring.of(["a", "b"], 1)
    server_peers = Peers(ring, {"a": ("127.0.0.1", 0), "b": ("127.0.0.1", 0)}, "b", JOB, "tok")
    server = ReplicaServer(store, server_peers, ("127.0.0.1", 0)).start()
    a = Peers(ring, {"a": ("127.0.0.1", 0), "b": ("127.0.0.1", server.port)}, "a", JOB, "tok")
    yield a, store, server
    server.close()
