"""Slots of several ranks written as the flash checkpointer writes them, for the replica tests
(tests/agent/replica, tests/system/test_replica_netns.py)."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from snapshot_helpers import captured, model_states, new_slot, write_raw_snapshot, write_snapshot

from diag.agent.replica.wire import Kind, Op, hello_body, parse_result, recv, send
from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import slot_path
from diag.formats.untrusted import Owners, UntrustedInput

JOB = "rj"
WORLD = 4  # two nodes of two ranks; node a holds ranks 0 and 1
CAP = 64 << 20
TOKEN = "replica-test-token-0123"  # a job's secret, as long as the agent asks
OWNERS = Owners.this_process()


def fill(
    run_dir: Path,
    save_dir: Path,
    steps: dict[int, list[int]],
    node: str = "a",
    run: str = "r1",
    world: int = WORLD,
) -> None:
    """rank -> the steps it writes, each into the next of its two slots."""
    slots: dict[tuple[int, int], SlotFile] = {}
    for rank, todo in steps.items():
        for i, step in enumerate(todo):
            key = (rank, i % 2)
            if key not in slots:
                path = slot_path(run_dir, JOB, rank, i % 2)
                slots[key] = (
                    SlotFile.open(path, writable=True)
                    if path.exists()
                    else new_slot(run_dir, JOB, rank, i % 2, world=world)
                )
            files = captured(
                {f"global_step{step}/zero_pp_rank_{rank}_optim.pt": model_states(step, rank)}
            )
            write_snapshot(slots[key], step, files, job=JOB, rank=rank, world=world,
                           save_dir=save_dir, node=node, run=run)  # fmt: skip
    for s in slots.values():
        s.close()


def raw_slots(run_dir: Path, save: Path, step: int, *, ranks: int) -> None:
    """Node a's ranks of a world of `ranks`, each with a slot of 8 MiB holding a small snapshot
    of raw files (no torch: quick)."""
    for rank in range(ranks):
        slot = new_slot(run_dir, JOB, rank, 0, world=ranks)
        write_raw_snapshot(slot, step, {f"global_step{step}/r{rank}.bin": b"x" * 1000},
                           job=JOB, rank=rank, world=ranks, save_dir=save, node="a",
                           run="r1")  # fmt: skip
        slot.close()


def handshake(sock: socket.socket, op: Op, node: str, job: str, holder: str, token: str) -> None:
    """A hand-made client's side of the authentication: it proves whatever `token` it has and,
    unlike the agent, does not check the holder's proof first (what a stranger can send)."""
    from diag.agent.replica.auth import NONCE_BYTES, Context, Role, proof
    from diag.agent.replica.wire import Auth, Hello, auth_body, parse_challenge

    mine = secrets.token_bytes(NONCE_BYTES)
    send(sock, Kind.HELLO, hello_body(Hello(op, node, job, holder, mine)))
    kind, body = recv(sock, (Kind.CHALLENGE, Kind.RESULT), "holder")
    if kind == Kind.RESULT:
        raise UntrustedInput("holder", f"refused: {parse_result(body, 'holder').error}")
    theirs = parse_challenge(body, "holder").nonce
    ctx = Context(job, node, holder, op.value)
    send(sock, Kind.AUTH, auth_body(Auth(proof(token.encode(), Role.CLIENT, ctx, mine, theirs))))
