"""The goodput bench's torchft stack (bench/goodput.py --stacks torchft): the job of
tests/support/jobs/torchft_job.py through the same schedule and node faults as GoodputJob, with
what torchft does differently:

- each node is one replica group: its own torchrun (standalone, --max-restarts 50) of its two
  ranks, which restarts the group when one of them ends; no rendezvous between the nodes;
- torchft's lighthouse, a process of the harness (its own pod in a cluster), listens where the
  other stacks' node-a hosts the c10d rendezvous, so the run waits for it the same way; the
  groups' Managers meet there for each step's quorum. Its settings: --min_replicas 1 (one group
  trains on alone) and torchft's defaults otherwise (a replica is dead 5 s after its last
  heartbeat; stragglers that heartbeat are waited for up to 60 s);
- the lighthouse is stopped with the launchers at the end (GoodputJob.close stops `master`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from goodputkit import Fault, GoodputJob, JobSpec, Node
from repo import JOBS

JOB = JOBS / "torchft_job.py"
# torchft's quorum: longer than the collective timeout plus the heartbeat timeout, which a healthy
# group can wait in it for a broken group to be seen gone (torchft_job.py says why).
QUORUM_TIMEOUT = 120.0
# torchft without its dependencies (its `torch>=2.7` must not move the pinned CPU build), then the
# two it needs at import.
INSTALL = (
    '.venv/bin/python -m pip install --no-deps "torchft==0.2.0" && .venv/bin/python -m pip '
    'install "opentelemetry-exporter-otlp-proto-http>=1.37.0" "opentelemetry-sdk>=1.37.0"'
)


def lighthouse_bin() -> Path | None:
    """torchft's lighthouse beside this Python (installed with the torchft package), or None."""
    found = Path(sys.executable).with_name("torchft_lighthouse")
    if found.exists():
        return found
    which = shutil.which("torchft_lighthouse")
    return Path(which) if which else None


class TorchftJob(GoodputJob):
    def __init__(self, spec: JobSpec, faults: list[Fault], root: Path, log: Callable[[str], None]):
        binary = lighthouse_bin()
        if binary is None:  # before the nodes' run directories are made
            raise RuntimeError(f"torchft's lighthouse is not installed: {INSTALL}")
        super().__init__(spec, faults, root, log)
        with open(root / "lighthouse.log", "wb") as f:
            self.master = subprocess.Popen(
                [str(binary), "--bind", f"127.0.0.1:{self.port}", "--min_replicas", "1"],
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def _launcher_cmd(self, node: Node) -> list[str]:
        s = self.spec
        group = [n.name for n in self.nodes].index(node.name)
        job = [str(JOB), "--group", str(group), "--lighthouse", f"http://127.0.0.1:{self.port}",
               "--steps", str(s.steps), "--hidden", str(s.hidden), "--out", str(self.out),
               "--faults", str(self.root / "faults.json"), "--pg-timeout", str(s.pg_timeout),
               "--quorum-timeout", str(QUORUM_TIMEOUT), "--groups", str(len(self.nodes))]  # fmt: skip
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(s.nproc), "--max-restarts", "50",
                "--monitor-interval", "0.1", *job]  # fmt: skip
