"""A node's agent SIGKILLed in the middle of pushing its replica (the kill suite's `replicate`
phase, faults.py): the holder, a real replica server, keeps the previous replica whole, and it
is that one a replaced node pulls back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from faults import Fired, Plan, write_json_atomic
from jobrun import free_port
from polling import wait_for
from replica_helpers import CAP, JOB, OWNERS, TOKEN, fill
from repo import SUPPORT, pythonpath

from diag.agent.replica.ring import Ring
from diag.agent.replica.store import STAGING_PREFIX, ReplicaStore
from diag.agent.replica.transport import Peers, ReplicaServer, pull
from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import HEADER_SIZE, find_slots, slot_path


# fraction -> the tick it fires at: a push ticks after its handshake, its manifest and each of the
# node's two parts (4 ticks), and fires at int(fraction x 5)
@pytest.mark.parametrize(("fraction", "tick"), [(0.5, 2), (0.7, 3)])
def test_a_kill_mid_push_leaves_the_holders_previous_replica_whole(
    tmp_path: Path, fraction: float, tick: int
) -> None:
    ports = {"a": free_port(), "b": free_port()}
    ring = Ring.of(["a", "b"], 1)
    addresses = {n: ("127.0.0.1", p) for n, p in ports.items()}
    store = ReplicaStore(tmp_path / "b-replicas", CAP)
    server = ReplicaServer(
        store, Peers(ring, addresses, "b", JOB, TOKEN), ("127.0.0.1", ports["b"])
    ).start()
    run_dir, save, ctl = tmp_path / "a-run", tmp_path / "save", tmp_path / "ctl"
    run_dir.mkdir()
    ctl.mkdir()
    fill(run_dir, save, {0: [1, 2], 1: [1, 2]})
    (ctl / "go").write_text("go")
    cmd = [
        sys.executable, str(SUPPORT / "jobs" / "fault_agent.py"), "--ctl", str(ctl), "--go",
        str(ctl / "go"), "--", "agent", "--run-dir", str(run_dir), "--job", JOB, "--node", "a",
        "--timeline", str(tmp_path / "timeline"), "--native-stacks", "false",
        "--replica-nodes", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()),
        "--replica-interval", "0.05",
    ]  # fmt: skip
    env = dict(
        os.environ, DIAG_REPLICA_TOKEN=TOKEN, DIAG_RUN_DIR=str(run_dir),
        PYTHONPATH=pythonpath(os.environ.get("PYTHONPATH", "")),
    )  # fmt: skip
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        held = lambda: (r := store.held("a")) is not None and r.manifest.step  # noqa: E731
        assert wait_for(lambda: held() == 2, 60), log.read_text()
        write_json_atomic(ctl / "plan.json", Plan(1, "replicate", (agent.pid,), "tick",
                                                  fraction).to_json())  # fmt: skip
        fill(run_dir, save, {0: [3], 1: [3]})  # a newer step: the next push is killed
        assert agent.wait(60) == -9, log.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
    fired = Fired.load(ctl / "fired-1.json")
    assert (fired.phase, fired.step, fired.tick) == ("replicate", 3, tick), fired
    # the holder drops what arrived of step 3 and keeps step 2 whole
    assert wait_for(lambda: not list(store.directory.glob(f"{STAGING_PREFIX}*")), 60)
    assert held() == 2
    again = ReplicaStore(store.directory, CAP)  # as a restarted holder finds it
    assert (r := again.held("a")) is not None and r.manifest.step == 2
    fresh = tmp_path / "a-run-new"  # the replaced node
    m, _ = pull(Peers(ring, addresses, "a", JOB, TOKEN), "b", fresh, max_bytes=CAP)
    server.close()
    assert m.step == 2
    got = {(s.meta.rank, s.meta.step) for s in read_snapshots(find_slots(fresh, JOB), OWNERS)}
    assert got == {(0, 2), (1, 2)}
    for rank in (0, 1):  # bit for bit the step the node held (its slot 1)
        part = next(p for p in m.parts if p.rank == rank)
        want = slot_path(run_dir, JOB, rank, 1).read_bytes()
        have = slot_path(fresh, JOB, rank, part.slot).read_bytes()
        assert have[HEADER_SIZE : part.nbytes] == want[HEADER_SIZE : part.nbytes]
