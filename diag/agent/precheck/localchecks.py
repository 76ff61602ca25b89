"""A node's own checks: GPU health (NVML), matmul throughput per device, intra-node copies.

Runs in a thread bounded by the local timeout: a wedged GPU must become a finding, not a hang.
"""

from __future__ import annotations

import logging
import socket
import threading

from diag.agent.node.linkstate import NicState
from diag.agent.precheck.devicehealth import NvmlWatch
from diag.agent.precheck.measurements import LocalEvidence
from diag.agent.precheck.precheckconfig import LocalCheck, Measure

log = logging.getLogger(__name__)


def run_local_checks(
    node: int, m: Measure, nic_state: NicState | None, timeout_s: float
) -> tuple[LocalEvidence, str]:
    """The evidence and the accelerator the node measured on ("cpu" or "cuda")."""
    result: list[tuple[LocalEvidence, str]] = []

    def work() -> None:
        result.append(_measure(node, m, nic_state))

    worker = threading.Thread(target=work, daemon=True, name="local-checks")
    worker.start()
    worker.join(timeout_s)
    if result:
        return result[0]
    evidence = LocalEvidence(
        node=node,
        host=socket.gethostname(),
        nic=nic_state,
        error=f"did not finish within {timeout_s:g} s",
    )
    return evidence, "cpu"


def _measure(node: int, m: Measure, nic_state: NicState | None) -> tuple[LocalEvidence, str]:
    from diag.agent.precheck import measure

    host = socket.gethostname()
    notes: list[str] = []
    watch = NvmlWatch()
    if LocalCheck.DEVICE in m.checks:
        watch.start()  # before our own allocations: memory in use must be someone else's
        if watch.note:
            notes.append(watch.note)
    try:
        accelerator, count = measure.detect_accelerator(m.device)
    except Exception as e:
        return LocalEvidence(node=node, host=host, nic=nic_state, error=str(e)), "cpu"
    compute = []
    if LocalCheck.COMPUTE in m.checks:
        devices = [f"cuda:{i}" for i in range(count)] if accelerator == "cuda" else ["cpu"]
        size = m.matmul_for(accelerator)
        compute = [
            measure.matmul_throughput(d, size, m.compute_seconds, m.compute_threads)
            for d in devices
        ]
    copies = []
    if LocalCheck.INTRA in m.checks:
        if accelerator != "cuda":
            notes.append("no GPU: intra-node device copies skipped")
        elif count < 2:
            notes.append("one GPU: intra-node device copies skipped")
        else:
            copies = [
                measure.copy_bandwidth(a, b, m.copy_bytes) for a, b in m.device_pairs.resolve(count)
            ]
    evidence = LocalEvidence(
        node=node,
        host=host,
        accelerator=accelerator,
        devices=watch.finish(),
        compute=tuple(compute),
        copies=tuple(copies),
        nic=nic_state,
        notes=tuple(notes),
    )
    return evidence, accelerator
