"""Test helpers for `diag precheck`: nodes as real processes, optionally inside network
namespaces joined by veth links to a bridge, with tbf shaping and link cuts.

Layout of a lab named P with N nodes:
  namespace P-sw holds bridge br0 and ports p0..pN-1;
  namespace P-n<i> holds eth0 (10.213.0.<i+1>/24), the other end of p<i>, and lo.
Nothing is created in the root namespace; deleting the namespaces removes everything.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DIAG = str(Path(sys.executable).with_name("diag"))
SUBNET = "10.213.0"
_counter = itertools.count()

# Small, quick runs: the machine has 2 cores shared with other test suites.
FAST_FLAGS = [
    "--msg-size",
    "2MiB",
    "--pair-seconds",
    "0.3",
    "--compute-seconds",
    "0.2",
    "--matmul-size",
    "256",
    "--connect-timeout",
    "6",
    "--collective-timeout",
    "6",
    "--lost-after",
    "4",
    "--heartbeat",
    "0.5",
    "--local-timeout",
    "60",
    # Thresholds with margin: shaped links are ~30x slower than unshaped ones here, while
    # unshaped numbers swing 2-3x with the load of other suites on the same cores.
    "--straggler-ratio",
    "0.2",
    "--compute-ratio",
    "0.2",
]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30, check=True)


def netns_unavailable() -> str | None:
    """Why network-namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    name = f"diag-probe-{os.getpid()}"
    try:
        out = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` is not usable: {e}"
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Node:
    """One `diag precheck` process and its files."""

    rank: int
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    report_path: Path

    def wait_log(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            if rx.search(self.err.read_text(errors="replace")):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(
            f"node {self.rank} never logged {pattern!r}:\n{self.err.read_text(errors='replace')}"
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"node {self.rank} still running after {timeout} s:\n{self.logs()}"
            ) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def report(self) -> dict:
        return json.loads(self.report_path.read_text())

    def logs(self) -> str:
        return (
            f"--- node {self.rank} stdout\n{self.out.read_text(errors='replace')}"
            f"--- node {self.rank} stderr\n{self.err.read_text(errors='replace')}"
        )


@dataclass
class Cluster:
    """Precheck nodes on this host: loopback by default, or inside a NetLab's namespaces."""

    n: int
    workdir: Path
    port: int
    lab: NetLab | None = None
    base_flags: list[str] = field(default_factory=lambda: list(FAST_FLAGS))
    nodes: dict[int, Node] = field(default_factory=dict)

    def master_addr(self) -> str:
        return self.lab.addr(0) if self.lab else "127.0.0.1"

    def start(self, rank: int, *extra: str) -> Node:
        out = self.workdir / f"node{rank}.out"
        err = self.workdir / f"node{rank}.err"
        report = self.workdir / f"node{rank}.json"
        cmd = [
            DIAG,
            "precheck",
            "--master-addr",
            self.master_addr(),
            "--master-port",
            str(self.port),
            "--nnodes",
            str(self.n),
            "--node-rank",
            str(rank),
            "--report",
            str(report),
            *self.base_flags,
            *extra,
        ]
        if self.lab:
            cmd = self.lab.exec_in(rank, cmd)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=REPO)
        node = Node(rank, proc, out, err, report)
        self.nodes[rank] = node
        return node

    def start_all(self, *extra: str, skip: tuple[int, ...] = ()) -> list[Node]:
        return [self.start(r, *extra) for r in range(self.n) if r not in skip]

    def wait_all(self, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        return {
            r: node.wait(max(1.0, deadline - time.monotonic())) for r, node in self.nodes.items()
        }

    def logs(self) -> str:
        return "\n".join(node.logs() for node in self.nodes.values())

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()


class NetLab:
    def __init__(self, n: int) -> None:
        self.n = n
        self.prefix = f"diag-pc-{os.getpid()}-{next(_counter)}"
        self.created: list[str] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_in(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` run inside node i's namespace. `ip netns exec` execs the command after
        entering the namespace, so the PID Popen gets is the command itself, and signals sent to
        it (or to its process tree) reach the real process."""
        return ["ip", "netns", "exec", self.ns(i), *cmd]

    def build(self) -> NetLab:
        _ip("netns", "add", self.switch)
        self.created.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)  # fmt: skip
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def shape(self, i: int, rate: str = "100mbit") -> None:
        """Shape node i's link both ways: its egress (eth0) and its ingress (switch port)."""
        for ns, dev in ((self.ns(i), "eth0"), (self.switch, f"p{i}")):
            _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "64kb", "latency", "100ms")  # fmt: skip

    def link_down(self, i: int) -> None:
        """Cut node i's cable: the switch port goes down, eth0 loses its carrier."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def close(self) -> None:
        for ns in reversed(self.created):
            _ip("netns", "del", ns, check=False)
        self.created.clear()
