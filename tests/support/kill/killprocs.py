"""The kill suite's processes (killsuite.py): the node's ranks (tests/support/jobs/kill_job.py), its
agent and, with replicas, the agent of the node holding its replica (tests/support/jobs/fault_agent.py).
Each imports everything, then waits for its go file, so that a replacement is ready ahead of a
kill.

On loopback the node and the holder share this machine's network and the ring uses two free
ports of 127.0.0.1. With a NetLab the node (its ranks, its agent and their replacements) runs in
namespace 0 and the holder in namespace 1: the ring names the two veth addresses, so the node's
pushes and the pull after a node kill cross the links. `ip netns exec` execs the command, so the
PID each Popen holds is the real process, the one a plan kills.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from killchecks import WORLD
from netlab import NetLab
from repo import JOBS

HOLDER_NODE, NODE = "node-b", "node-a"
NODE_NS, HOLDER_NS = 0, 1  # a NetLab's namespaces
RING_PORT = 7070  # with a NetLab each agent listens in its own namespace: any port is free there


def replica_ring(lab: NetLab | None) -> str:
    """`--replica-nodes`: the node, then its holder, the next node of the ring."""
    if lab is not None:
        node, holder = lab.addr(NODE_NS), lab.addr(HOLDER_NS)
        return f"{NODE}={node}:{RING_PORT},{HOLDER_NODE}={holder}:{RING_PORT}"
    from jobrun import free_port

    return f"{NODE}=127.0.0.1:{free_port()},{HOLDER_NODE}=127.0.0.1:{free_port()}"


@dataclass
class Launcher:
    """Starts the node's ranks, its agent and the holder's agent of one stage's job, each logging
    to its file under `root`."""

    root: Path
    zero: int
    job: str
    persist_every: int
    run_dir: Path  # the node's (its shared memory)
    holder_run: Path
    env: dict[str, str]
    ring: str = ""  # with replicas: `--replica-nodes`
    lab: NetLab | None = None

    @property
    def ctl(self) -> Path:
        return self.root / "ctl"

    def ranks(self, gen: int) -> list[subprocess.Popen]:
        procs = []
        for rank in range(WORLD):
            env = dict(
                self.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                LOCAL_WORLD_SIZE=str(WORLD),
            )  # fmt: skip
            if self.lab is not None:
                # gloo binds the address the host name resolves to, in no namespace of the lab:
                # the node's ranks talk over its loopback (their store is a file).
                env["GLOO_SOCKET_IFNAME"] = "lo"
            cmd = [
                sys.executable, str(JOBS / "kill_job.py"), "--zero", str(self.zero),
                "--job", self.job, "--save-dir", str(self.root / "ckpt"), "--ctl", str(self.ctl),
                "--gen", str(gen), "--persist-every", str(self.persist_every),
            ]  # fmt: skip
            procs.append(self._popen(NODE_NS, cmd, env, f"ranks-{gen}.log"))
        return procs

    def agent(self, gen: int) -> subprocess.Popen:
        cmd = [
            sys.executable, str(JOBS / "fault_agent.py"), "--ctl", str(self.ctl),
            "--go", str(self.ctl / f"agent-go-{gen}"), "--", "agent",
            "--run-dir", str(self.run_dir), "--job", self.job,
            "--timeline", str(self.root / "timeline"),
            "--native-stacks", "false", "--interval", "0.5", "--keep-last", "3", "-v",
        ]  # fmt: skip
        if self.ring:
            # The default --replica-interval: the ranks' notes of each completed snapshot wake
            # the pushes (replication rounds), not the timer.
            cmd += ["--replica-nodes", self.ring]
            # In the node's memory (its run directory), where the suite looks and a wipe reaches.
            cmd += ["--replica-dir", str(self.run_dir / ".replicas")]
        return self._popen(NODE_NS, cmd, self.env, "agent.log")

    def holder(self) -> subprocess.Popen:
        go = self.ctl / "holder-go"  # the holder starts at once
        go.touch()
        cmd = [
            sys.executable, str(JOBS / "fault_agent.py"), "--ctl", str(self.ctl), "--go", str(go),
            "--", "agent", "--run-dir", str(self.holder_run),
            "--job", self.job, "--node", HOLDER_NODE, "--timeline", str(self.root / "timeline"),
            "--native-stacks", "false", "--replica-nodes", self.ring, "-v",
            "--replica-dir", str(self.holder_run / ".replicas"),
        ]  # fmt: skip
        env = dict(self.env, DIAG_RUN_DIR=str(self.holder_run), DIAG_NODE=HOLDER_NODE)
        return self._popen(HOLDER_NS, cmd, env, "holder.log")

    def _popen(self, ns: int, cmd: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        if self.lab is not None:
            cmd = self.lab.exec_in(ns, cmd)
        with open(self.root / log, "ab") as out:
            return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def reap(p: subprocess.Popen, timeout: float, sig: signal.Signals | None = None) -> None:
    """Waits for `p` to end (after `sig`, when given), SIGKILLs it past `timeout`."""
    if p.poll() is not None:
        return
    if sig is not None:
        p.send_signal(sig)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)
