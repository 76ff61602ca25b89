"""This node's side of replication: what of its own slots it sends, and installing a pulled
replica back into its run directory as its ranks' slots.

What is sent is the newest step every local rank holds complete, from one launch (ring.step_to_send),
read straight from the ranks' slot files under a shared lock. An installed part is written under a
temporary name as a torn slot, checked, marked complete and renamed to the rank's slot name, so a
rank starting meanwhile sees either no slot or a whole one; once installed, the ranks load it
exactly as after a process restart (trainer.flash.restore).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from diag.agent.replica.parts import new_part_file, receive_part
from diag.agent.replica.ring import Held, step_to_send
from diag.agent.replica.wire import Manifest, Part
from diag.formats.slotfile import Snapshot, open_slot, read_snapshots
from diag.formats.snapshot import find_slots, slot_path
from diag.formats.untrusted import Owners, open_dir


@dataclass(frozen=True)
class LocalReplica:
    """What this node would send: the manifest and each part's slot file."""

    manifest: Manifest
    paths: tuple[Path, ...]  # in the manifest's part order


def local_ranks(run_dir: Path, job: str, owners: Owners) -> list[int]:
    """The ranks with slot files in the run directory (complete or not)."""
    ranks = set()
    for p in find_slots(run_dir, job):
        slot = open_slot(p, owners)
        if slot is None:
            continue
        try:
            ranks.add(slot.header().rank)
        except ValueError:
            pass
        finally:
            slot.close()
    return sorted(ranks)


@dataclass(frozen=True)
class Found:
    """What a look at the node's slots found to send, and the node names its snapshots carry."""

    replica: LocalReplica | None
    nodes: frozenset[str]  # every node name the job's complete snapshots here name


def local_replica(run_dir: Path, job: str, node: str, owners: Owners) -> LocalReplica | None:
    """The newest replication round's step (trainer.flash.replicarounds) complete on every local rank,
    as a manifest, or None."""
    return look(run_dir, job, node, owners).replica


def look(run_dir: Path, job: str, node: str, owners: Owners) -> Found:
    """Only round steps are sent: every node of the job sends the same steps, so the steps each
    rank keeps are the ones its peers' holders may hold."""
    every = read_snapshots(find_slots(run_dir, job), owners)
    nodes = frozenset(s.meta.node for s in every)
    snaps = [s for s in every if s.meta.node == node and s.meta.replica_round]
    return Found(_manifest(run_dir, job, node, owners, snaps), nodes)


def _manifest(
    run_dir: Path, job: str, node: str, owners: Owners, snaps: list[Snapshot]
) -> LocalReplica | None:
    ranks = local_ranks(run_dir, job, owners)
    chosen = step_to_send(ranks, [Held(s.meta.rank, s.meta.step, s.meta.run) for s in snaps])
    if chosen is None:
        return None
    step, run = chosen
    parts, paths = [], []
    worlds = set()
    for rank in ranks:
        mine = [s for s in snaps if (s.meta.rank, s.meta.step, s.meta.run) == (rank, step, run)]
        best = max(mine, key=lambda s: s.header.gen)
        h = best.header
        parts.append(Part(rank, h.slot, h.meta_offset + h.meta_len))
        paths.append(best.path)
        worlds.add(best.meta.world_size)
    if len(worlds) != 1:
        return None  # ranks of two job layouts: not one step
    return LocalReplica(Manifest(node, job, step, run, worlds.pop(), tuple(parts)), tuple(paths))


def local_steps(run_dir: Path, job: str, node: str, owners: Owners) -> list[int]:
    """Every complete step this node's slots hold (any rank)."""
    snaps = read_snapshots(find_slots(run_dir, job), owners)
    return sorted({s.meta.step for s in snaps if s.meta.node == node})


def install(
    sock: socket.socket, m: Manifest, run_dir: Path, source: str, *, capacity_cap: int
) -> list[Path]:
    """Receives every part of `m` from `sock` into the run directory as the ranks' slots: all of
    them or, when one fails, none. The files take at most `capacity_cap` bytes in all (the parts,
    and what is left of the cap as room for the ranks' next snapshots)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(run_dir)
    d = open_dir(run_dir)
    received: list[tuple[str, Path]] = []
    try:
        room = capacity_cap - m.nbytes
        for part in m.parts:
            final = slot_path(run_dir, m.job, part.rank, part.slot)
            tmp = f".{final.name}.pull-{secrets.token_hex(4)}"
            fd = new_part_file(tmp, dir_fd=d)
            received.append((tmp, final))
            try:
                if os.geteuid() == 0 and st.st_uid != 0:
                    os.fchown(fd, st.st_uid, st.st_gid)  # the ranks' user writes it next
                size = receive_part(sock, fd, part, m, source, where=run_dir, room=room)
                room -= size - part.nbytes
            finally:
                os.close(fd)
        # every part checked: only now do they become the ranks' slots
        for tmp, final in received:
            os.rename(tmp, final.name, src_dir_fd=d, dst_dir_fd=d)
        return [final for _, final in received]
    except BaseException:
        for tmp, _ in received:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=d)
        raise
    finally:
        os.close(d)
