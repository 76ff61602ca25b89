"""A whole node lost from a job across nodes, at the pace that used to lose steps: two nodes on
this machine (a run directory each, a real `diag agent` with `--replica-nodes` and a torchrun of
one ZeRO-2 rank each, rendezvous on loopback), a step every 0.2 s, storage every 20 steps. Node b
is lost (its rank, torchrun and agent SIGKILLed, its shared memory wiped) and comes back empty:
its new agent pulls its replica from node a, and the job restarted on both nodes resumes from
that replica's step, from memory, on both ranks, never from storage's older step. Before the
replication rounds (trainer.flash.replicarounds) node a's rank had often written over the step
b's holder held, and the job fell back to storage.

Long tier: four DeepSpeed ranks start, past 45 s of CPU (the default tier has the rounds over
a rank's real slots and in simulation, tests/trainer/flash/test_replica_rounds.py); bench/node_loss_bench.py
loops it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from twonodes import PERSIST_EVERY, TwoNodes, lose_and_restart, start_job, wait_for

from diag.formats.snapshot import read_latest_step

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]


@pytest.fixture
def nodes():
    root = Path(tempfile.mkdtemp(prefix="diag-test-nodeloss-"))
    c = TwoNodes(root)
    try:
        yield c
    finally:
        c.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_lost_node_comes_back_at_its_replica_s_step_from_memory(nodes: TwoNodes) -> None:
    c = nodes
    start_job(c, "first")
    # Past storage's first step, at a step storage does not hold: the loss costs steps unless
    # the replica is used.
    wait_for(lambda: (read_latest_step(c.save) or 0) >= PERSIST_EVERY, 400,
             f"step {PERSIST_EVERY} committed", c.logs)  # fmt: skip
    loss = lose_and_restart(c, "first", "second", past=5)
    assert loss.held is not None and loss.storage is not None, (loss, c.logs())
    assert loss.held > loss.storage, loss
    # node b's new agent pulled its replica from node a before its rank started
    assert loss.pulled, (loss, c.logs())
    # Both ranks resumed from memory at the replica's step (the newest step both held, or the
    # one in flight to the holder), not from storage's older one.
    assert (loss.start["from"], loss.start["step"]) == ("memory", loss.held), (loss, c.logs())
    # The replica trails the newest step by the rounds' confirmations (a few steps on a loaded
    # machine): no speed is asserted here, bench/node_loss_bench.py measures it.
    assert loss.held <= loss.newest, loss
    assert not loss.fell_back_logged, loss
