"""A restoring node's pull against a holder whose part headers each claim a slot as large as the
cap, over real TCP on 127.0.0.1 (finding A8 of the security review): the node's own cap bounds
what the pull reserves, in all."""

from __future__ import annotations

import socket
import threading

from replica_helpers import JOB, OWNERS, raw_slots

from diag.agent.replica.parts import send_part
from diag.agent.replica.source import install, local_replica
from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import find_slots


def test_a_pulls_reservations_stay_under_the_cap_in_all(tmp_path) -> None:
    """A8. Four parts whose headers each claim a slot of the cap's size reserve, together, no
    more than the cap (the ranks' room for their next snapshots shares one allowance)."""
    run_dir = tmp_path / "a-run"
    run_dir.mkdir()
    cap = 8 << 20
    raw_slots(run_dir, tmp_path / "save", 5, ranks=4)  # each slot has room for the cap
    local = local_replica(run_dir, JOB, "a", OWNERS)
    assert local is not None and len(local.manifest.parts) == 4
    listener = socket.create_server(("127.0.0.1", 0))

    def holder() -> None:
        conn, _ = listener.accept()
        with conn:
            for part, path in zip(local.manifest.parts, local.paths, strict=True):
                send_part(conn, path, part, 5, OWNERS, lock_timeout=5)
            conn.recv(1)

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    fresh = tmp_path / "fresh"
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            paths = install(sock, local.manifest, fresh, "holder", capacity_cap=cap)
    finally:
        listener.close()
        t.join(10)
    assert len(paths) == 4
    assert sum(p.stat().st_size for p in paths) <= cap
    snaps = read_snapshots(find_slots(fresh, JOB), OWNERS)
    assert sorted((s.meta.rank, s.meta.step) for s in snaps) == [(r, 5) for r in range(4)]
