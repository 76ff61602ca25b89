"""Replicas between two real replica servers over TCP on this machine: a node's newest complete
step is pushed to its holder, pulled back into an empty run directory as the ranks' slots, and
found there by the trainer's restore index exactly as the lost slots were; hostile peers, cut
connections and restarts leave no torn or mixed replica."""

from __future__ import annotations

import errno
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from replica_helpers import CAP, JOB, OWNERS, WORLD, fill, handshake

from diag.agent.replica.admission import Limits
from diag.agent.replica.ring import Ring
from diag.agent.replica.source import local_replica
from diag.agent.replica.store import STAGING_PREFIX, ReplicaStore
from diag.agent.replica.transport import Peers, ReplicaServer, ask_offer, pull, push
from diag.agent.replica.wire import (
    CHUNK,
    Kind,
    Op,
    manifest_body,
    parse_result,
    recv,
    send,
)
from diag.formats.slotfile import read_snapshots
from diag.formats.snapshot import HEADER_SIZE, find_slots
from diag.formats.untrusted import UntrustedInput


def slot_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return data[HEADER_SIZE:]


def test_push_offer_pull_restores_the_newest_common_step(tmp_path, ring2):
    a, store, _ = ring2
    run_dir, save = tmp_path / "a-run", tmp_path / "save"
    run_dir.mkdir()
    # rank 0 finished step 6, rank 1 was killed copying it: step 5 is the node's newest
    fill(run_dir, save, {0: [5, 6], 1: [5]})
    local = local_replica(run_dir, JOB, "a", OWNERS)
    assert local is not None and local.manifest.step == 5 and local.manifest.ranks == (0, 1)
    originals = {p.name: p.read_bytes() for p in local.paths}

    result = push(a, "b", local, OWNERS)
    assert result.ok, result.error
    held = store.held("a")
    assert held is not None and held.manifest.step == 5
    offer = ask_offer(a, "b")
    assert (offer.step, offer.run, offer.ranks) == (5, "r1", (0, 1))

    fresh = tmp_path / "a-run-new"  # the replaced node: nothing in memory
    m, paths = pull(a, "b", fresh, max_bytes=CAP)
    assert m.step == 5 and sorted(p.name for p in paths) == sorted(originals)
    snaps = read_snapshots(find_slots(fresh, JOB), OWNERS)
    assert sorted((s.meta.rank, s.meta.step) for s in snaps) == [(0, 5), (1, 5)]
    for p, part in zip(paths, m.parts, strict=True):
        want, got = originals[p.name], p.read_bytes()
        assert len(got) == len(want)  # the slot's room, for the rank's next snapshots
        # data and description, bit for bit
        assert got[HEADER_SIZE : part.nbytes] == want[HEADER_SIZE : part.nbytes]
    assert not [p for p in fresh.iterdir() if p.name.startswith(".")]


def test_the_trainer_restore_index_finds_the_pulled_step(tmp_path, ring2):
    from diag.trainer.flash.restore import Place, memory_index

    a, _, _ = ring2
    run_dir, save = tmp_path / "a-run", tmp_path / "save"
    run_dir.mkdir()
    fill(run_dir, save, {0: [3, 4], 1: [3, 4]})
    local = local_replica(run_dir, JOB, "a", OWNERS)
    assert local is not None and push(a, "b", local, OWNERS).ok
    fresh = tmp_path / "fresh"
    pull(a, "b", fresh, max_bytes=CAP)
    for rank in (0, 1):
        place = Place(fresh, JOB, "a", rank, WORLD, str(save))
        index = memory_index(place, lambda tag, r=rank: {f"{tag}/zero_pp_rank_{r}_optim.pt"})
        assert set(index) == {4}


def test_a_newer_push_replaces_the_replica(tmp_path, ring2):
    a, store, _ = ring2
    run_dir, save = tmp_path / "a-run", tmp_path / "save"
    run_dir.mkdir()
    fill(run_dir, save, {0: [1, 2], 1: [1, 2]})
    assert push(a, "b", local_replica(run_dir, JOB, "a", OWNERS), OWNERS).ok
    first = store.held("a")
    fill(run_dir, save, {0: [3, 4], 1: [3, 4]})
    assert push(a, "b", local_replica(run_dir, JOB, "a", OWNERS), OWNERS).ok
    assert store.held("a").manifest.step == 4
    assert not first.path.exists()  # one replica per peer
    assert len([p for p in store.directory.iterdir()]) == 1


@dataclass(frozen=True)
class As:
    """Who a hand-made client says it is."""

    node: str = "a"
    job: str = JOB
    token: str = "tok"
    holder: str = "b"


def raw_push(port: int, who: As, manifest: dict | None, payload: bytes = b"", *, close=False):
    """A hand-made client: what a hostile or broken peer can send, after the handshake."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            handshake(sock, Op.PUSH, who.node, who.job, who.holder, who.token)
            if manifest is not None:
                send(sock, Kind.MANIFEST, manifest)
            sock.sendall(payload)
            if close:
                return None
            return parse_result(recv(sock, Kind.RESULT, "server")[1], "server")
        except (OSError, UntrustedInput):
            return None


@pytest.mark.parametrize(
    ("who", "problem"),
    [
        (As(token="wrong"), "wrong proof of the replica token"),
        (As(job="other-job"), "of job 'other-job'"),
        (As(node="zz"), "not a peer of the ring"),
        (As(node="b"), "not a peer of the ring"),  # itself
        (As(holder="c"), "meant node 'c'"),  # a connection meant for another holder
    ],
)
def test_strangers_are_refused(ring2, who, problem):
    _, store, server = ring2
    events: list[tuple[str, str]] = []
    server.on_event = lambda kind, detail: events.append((kind, detail))
    result = raw_push(server.port, who, None)
    assert result is None or not result.ok
    assert wait_until(lambda: events), events
    assert events[0][0] == "refused" and problem in events[0][1], events
    assert store.held("a") is None


def test_a_holder_without_the_token_is_not_believed(tmp_path, ring2):
    """The client checks the holder's proof before it sends or believes anything."""
    a, _, _ = ring2
    wrong = Peers(a.ring, a.addresses, "a", JOB, "not-the-token")
    with pytest.raises(UntrustedInput, match="did not prove"):
        ask_offer(wrong, "b")


def test_a_node_the_holder_does_not_hold_for_is_refused(tmp_path):
    ring = Ring.of(["a", "b", "c"], 1)  # b holds a's replica only
    addrs = {n: ("127.0.0.1", 0) for n in ring.nodes}
    store = ReplicaStore(tmp_path / "b", CAP)
    server = ReplicaServer(store, Peers(ring, addrs, "b", JOB, "t"), ("127.0.0.1", 0)).start()
    events: list[str] = []
    server.on_event = lambda kind, detail: events.append(detail)
    try:
        result = raw_push(server.port, As(node="c", token="t"), None)
        assert result is None or not result.ok
        assert wait_until(lambda: events) and "not one b holds replicas of" in events[0]
    finally:
        server.close()


def manifest_of(run_dir: Path) -> tuple[dict, bytes]:
    local = local_replica(run_dir, JOB, "a", OWNERS)
    assert local is not None
    return manifest_body(local.manifest), b"".join(
        p.read_bytes()[: part.nbytes]
        for p, part in zip(local.paths, local.manifest.parts, strict=True)
    )


def test_hostile_manifests_and_parts_leave_the_previous_replica(tmp_path, ring2):
    a, store, server = ring2
    run_dir, save = tmp_path / "a-run", tmp_path / "save"
    run_dir.mkdir()
    fill(run_dir, save, {0: [1], 1: [1]})
    assert push(a, "b", local_replica(run_dir, JOB, "a", OWNERS), OWNERS).ok
    good = store.held("a")
    fill(run_dir, save, {0: [1, 2], 1: [1, 2]})
    body, payload = manifest_of(run_dir)
    who = As()

    cases = {
        "over the cap": ({**body, "parts": [[0, 1, CAP], [1, 1, CAP]]}, payload),
        "step mismatch": ({**body, "step": 7}, payload),
        "rank twice": ({**body, "parts": [body["parts"][0], body["parts"][0]]}, payload),
        "size mismatch": (
            {**body, "parts": [[r, s, n + 64] for r, s, n in body["parts"]]},
            payload,
        ),
        "another node's": ({**body, "node": "b"}, payload),
        "torn part": (body, payload[:16] + b"\x07" + payload[17:]),  # odd generation
        "cut short": (body, payload[: len(payload) // 2]),
    }
    ended: list[str] = []
    server.on_event = lambda kind, detail: ended.append(kind)
    for what, (m, data) in cases.items():
        result = raw_push(server.port, who, m, data, close=what == "cut short")
        assert result is None or not result.ok, what
        assert store.held("a") == good, what
    # the connection cut in the middle ends when the server sees the socket close
    assert wait_until(lambda: len(ended) == len(cases)), ended
    assert ended == ["refused"] * len(cases)
    assert not staging(store)
    assert [p.name for p in store.directory.iterdir()] == [good.path.name]


def test_a_description_naming_another_node_is_refused(tmp_path, ring2):
    a, store, _ = ring2
    run_dir, save = tmp_path / "a-run", tmp_path / "save"
    run_dir.mkdir()
    fill(run_dir, save, {0: [1], 1: [1]}, node="z")  # slots of node z sent as a's
    snaps = read_snapshots(find_slots(run_dir, JOB), OWNERS)
    assert {s.meta.node for s in snaps} == {"z"}
    assert local_replica(run_dir, JOB, "a", OWNERS) is None  # a never sends another's slots
    # forced through by hand: the holder checks the description
    from diag.agent.replica.source import LocalReplica
    from diag.agent.replica.wire import Manifest, Part

    parts = tuple(
        Part(s.meta.rank, s.header.slot, s.header.meta_offset + s.header.meta_len) for s in snaps
    )
    forged = LocalReplica(Manifest("a", JOB, 1, "r1", WORLD, parts), tuple(s.path for s in snaps))
    result = push(a, "b", forged, OWNERS)
    assert not result.ok and "does not match the manifest" in result.error
    assert store.held("a") is None and not staging(store)


def test_a_restarted_holder_finds_its_replicas_and_drops_half_received_ones(tmp_path, ring2):
    a, store, _ = ring2
    run_dir, save = tmp_path / "a-run", tmp_path / "save"
    run_dir.mkdir()
    fill(run_dir, save, {0: [1], 1: [1]})
    assert push(a, "b", local_replica(run_dir, JOB, "a", OWNERS), OWNERS).ok
    (store.directory / f"{STAGING_PREFIX}a-0badcafe").mkdir()  # what a killed holder leaves
    (store.directory / "a-9-0123abcd").mkdir()  # renamed, its manifest lost
    again = ReplicaStore(store.directory, CAP)
    assert again.held("a") is not None and again.held("a").manifest.step == 1
    assert sorted(p.name for p in store.directory.iterdir()) == [store.held("a").path.name]


def test_pull_of_a_node_without_replica_says_so(tmp_path, ring2):
    a, _, _ = ring2
    assert ask_offer(a, "b").step is None
    with pytest.raises(UntrustedInput, match="nothing to give"):
        pull(a, "b", tmp_path / "fresh", max_bytes=CAP)


def staging(store: ReplicaStore) -> list[Path]:
    return [p for p in store.directory.iterdir() if p.name.startswith(STAGING_PREFIX)]


def wait_until(pred, timeout: float = 30.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if pred():
            return True
        done.wait(0.05)
    return bool(pred())


def test_connections_waiting_past_the_bound_drop_the_oldest(tmp_path):
    ring = Ring.of(["a", "b"], 1)
    addrs = {"a": ("127.0.0.1", 0), "b": ("127.0.0.1", 0)}
    server = ReplicaServer(
        ReplicaStore(tmp_path / "b", CAP), Peers(ring, addrs, "b", JOB, "tok"), ("127.0.0.1", 0),
        limits=Limits(max_pending=2),
    ).start()  # fmt: skip
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10)]
        assert wait_until(lambda: server.gate.waiting() == 1)
        idle += [socket.create_connection(("127.0.0.1", server.port), timeout=10)]
        assert wait_until(lambda: server.gate.waiting() == 2)
        idle += [socket.create_connection(("127.0.0.1", server.port), timeout=10)]
        # a third waits: the oldest is dropped without a word, the newer two still wait
        assert idle[0].recv(1) == b""
        assert wait_until(lambda: server.gate.waiting() == 2)
        # a real peer, newer than both, is served all the same
        peers = Peers(ring, {"a": ("127.0.0.1", 0), "b": ("127.0.0.1", server.port)}, "a", JOB,
                      "tok")  # fmt: skip
        assert ask_offer(peers, "b").step is None
        for s in idle:
            s.close()
    finally:
        server.close()


def big_slots(run_dir: Path, save: Path, step: int, nbytes: int) -> None:
    """Ranks 0 and 1 of node a, each with a part of several receive chunks."""
    from snapshot_helpers import captured, new_slot, write_snapshot

    for rank in (0, 1):
        slot = new_slot(run_dir, JOB, rank, 0, world=WORLD)
        raw = {f"global_step{step}/blob{rank}.bin": os.urandom(nbytes)}
        files = captured({}, raw=raw)
        write_snapshot(slot, step, files, job=JOB, rank=rank, world=WORLD, save_dir=save,
                       node="a", run="r1")  # fmt: skip
        slot.close()


@pytest.mark.parametrize("fallocate", ["supported", "unsupported"])
def test_parts_of_many_chunks_arrive_bit_for_bit(tmp_path, ring2, monkeypatch, fallocate):
    """A part is received straight into the file's mapping where the file's blocks are reserved,
    through a buffer where the file system cannot reserve them; both give the same bytes."""
    if fallocate == "unsupported":

        def no_fallocate(fd, offset, length):
            raise OSError(errno.EOPNOTSUPP, "not supported")

        monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    a, store, server = ring2
    run_dir, save = tmp_path / "a-run", tmp_path / "save"
    run_dir.mkdir()
    big_slots(run_dir, save, 3, CHUNK + (CHUNK // 2) + 7)
    local = local_replica(run_dir, JOB, "a", OWNERS)
    assert local is not None and all(p.nbytes > CHUNK for p in local.manifest.parts)
    result = push(a, "b", local, OWNERS)
    assert result.ok, result.error
    held = store.held("a")
    assert held is not None and held.manifest.step == 3
    for part, path in zip(local.manifest.parts, local.paths, strict=True):
        got = held.part_path(part).read_bytes()
        assert got[HEADER_SIZE : part.nbytes] == path.read_bytes()[HEADER_SIZE : part.nbytes]
    fresh = tmp_path / "fresh"
    m, paths = pull(a, "b", fresh, max_bytes=CAP)
    snaps = read_snapshots(find_slots(fresh, JOB), OWNERS)
    assert sorted((s.meta.rank, s.meta.step) for s in snaps) == [(0, 3), (1, 3)]
    for p, part, src in zip(paths, m.parts, local.paths, strict=True):
        assert (
            p.read_bytes()[HEADER_SIZE : part.nbytes] == src.read_bytes()[HEADER_SIZE : part.nbytes]
        )

    # cut after the first chunk of a part: torn, dropped, the previous replica kept
    body, payload = manifest_of(run_dir)
    ended: list[str] = []
    server.on_event = lambda kind, detail: ended.append(kind)
    assert raw_push(server.port, As(), body, payload[: CHUNK + 4096], close=True) is None
    assert wait_until(lambda: ended == ["refused"]), ended
    assert store.held("a") == held and not staging(store)
