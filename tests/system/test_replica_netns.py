"""Three nodes as three network namespaces, a real `diag agent` in each with `--replica-nodes`:
each node's newest complete snapshot (slots as the flash checkpointer writes them) is held in the
next node's memory, sent over the veth links; a node killed and wiped (agent and shared memory
lost) gets its ranks' slots back from its holder at the next agent's start, bit for bit; with
the holder gone too, it names storage."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netlab import NetLab, netns_unavailable
from replica_helpers import JOB, OWNERS, fill

from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import HEADER_SIZE, find_slots

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(300)]

NODES = ("node-a", "node-b", "node-c")
PORT = 7070  # each agent listens in its own namespace: any port is free there
RANKS = {"node-a": (0, 1), "node-b": (2, 3), "node-c": (4, 5)}


def wait_for(pred, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s:\n{logs()}"
        time.sleep(0.1)


class Nodes:
    def __init__(self, tmp: Path, lab: NetLab) -> None:
        self.tmp = tmp
        self.lab = lab
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.save = tmp / "save"
        self.save.mkdir()
        self.spec = ",".join(f"{n}={lab.addr(i)}:{PORT}" for i, n in enumerate(NODES))

    def run_dir(self, node: str) -> Path:
        return self.tmp / f"run-{node}"

    def start(self, node: str) -> None:
        i = NODES.index(node)
        env = dict(os.environ, DIAG_REPLICA_TOKEN="job-secret-replica-token", OMP_NUM_THREADS="1")
        log = open(self.tmp / f"agent-{node}.log", "ab")  # noqa: SIM115
        self.agents[node] = subprocess.Popen(
            self.lab.exec_in(i, [
                sys.executable, "-m", "diag.cli.main", "agent", "--run-dir",
                str(self.run_dir(node)), "--timeline", str(self.tmp / "timeline"), "--job", JOB,
                "--node", node, "--replica-nodes", self.spec, "--replica-interval", "0.2",
                "--replica-dir", str(self.run_dir(node) / ".replicas"),
                "--save-dir", str(self.save), "--native-stacks", "false", "-v"]),
            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def kill(self, node: str, wipe: bool) -> None:
        p = self.agents.pop(node)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        if wipe:  # a replaced node: its shared memory went with it
            shutil.rmtree(self.run_dir(node))

    def held(self, holder: str, node: str) -> list[int]:
        """Steps of `node`'s complete replicas in `holder`'s replica directory."""
        d = self.run_dir(holder) / ".replicas"
        if not d.is_dir():
            return []
        return sorted(
            int(p.name.split("-")[-2])
            for p in d.glob(f"{node}-*-*")
            if (p / "replica.json").exists()
        )

    def log(self, node: str) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / f"agent-{node}.log").read_text(errors="replace")
        return ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in NODES)

    def close(self) -> None:
        for p in self.agents.values():
            p.send_signal(signal.SIGTERM)
        for p in self.agents.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


@pytest.fixture
def nodes(tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    lab = NetLab(len(NODES))
    n = Nodes(tmp_path, lab)
    try:
        lab.build()
        yield n
    finally:
        try:
            n.close()
        finally:
            lab.close()


def slots_of(run_dir: Path) -> dict[tuple[int, int], bytes]:
    """(rank, step) -> the slot's used bytes past the header (data and description)."""
    out = {}
    for s in read_snapshots(find_slots(run_dir, JOB), OWNERS):
        used = s.header.meta_offset + s.header.meta_len
        out[(s.meta.rank, s.meta.step)] = s.path.read_bytes()[HEADER_SIZE:used]
    return out


def test_a_wiped_node_takes_its_slots_back_from_its_holder_then_storage(nodes: Nodes) -> None:
    for node in NODES:
        nodes.run_dir(node).mkdir(mode=0o700)
        fill(nodes.run_dir(node), nodes.save, {r: [3] for r in RANKS[node]}, node=node, world=6)
        nodes.start(node)
    holder = {"node-a": "node-b", "node-b": "node-c", "node-c": "node-a"}
    for node, h in holder.items():
        wait_for(lambda n=node, h=h: nodes.held(h, n) == [3], 120, f"{h} holds {node}'s step 3",
                 nodes.logs)  # fmt: skip

    # node-a's ranks complete step 4; its agent sends it to node-b, which keeps one replica
    fill(nodes.run_dir("node-a"), nodes.save, {0: [3, 4], 1: [3, 4]}, node="node-a", world=6)
    wait_for(lambda: nodes.held("node-b", "node-a") == [4], 60, "node-b holds step 4", nodes.logs)
    before = slots_of(nodes.run_dir("node-a"))

    # node-a is lost and replaced: nothing of its memory is left
    nodes.kill("node-a", wipe=True)
    nodes.start("node-a")
    wait_for(lambda: "replica restore: peer step 4" in nodes.log("node-a"), 120,
             "node-a restored step 4 from node-b", nodes.logs)  # fmt: skip
    after = slots_of(nodes.run_dir("node-a"))
    assert set(after) == {(0, 4), (1, 4)}
    assert all(after[k] == before[k] for k in after), "the pulled slots differ from the lost ones"
    # and the returning node holds node-c's replica again
    wait_for(lambda: nodes.held("node-a", "node-c") == [3], 60, "node-a holds node-c's again",
             nodes.logs)  # fmt: skip

    # node-a and its holder are lost together: storage is all that is left
    (nodes.save / "latest").write_text("global_step2")
    nodes.kill("node-a", wipe=True)
    nodes.kill("node-b", wipe=True)
    nodes.start("node-a")
    wait_for(lambda: nodes.log("node-a").count("replica restore: ") >= 3, 120,
             "node-a's third start chose", nodes.logs)  # fmt: skip
    assert "replica restore: storage step 2" in nodes.log("node-a"), nodes.log("node-a")
    assert not find_slots(nodes.run_dir("node-a"), JOB)
