"""The op journal: wrap-around, readers racing a writer, and writers killed mid-record."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
import struct
import time
from pathlib import Path

import pytest

from diag.formats.journal import HEADER_SIZE, JournalFormatError, JournalStatus
from diag.formats.journalreader import JournalReader
from diag.formats.journalwriter import JournalWriter
from diag.formats.records import SLOT_SIZE, OpCode, OpFlag, OpState, RecordKind


def _writer(path: Path, capacity: int = 64) -> JournalWriter:
    return JournalWriter(path, rank=3, world_size=8, local_rank=1, capacity=capacity)


def _op(w: JournalWriter, i: int, *, live: bool = False) -> int:
    return w.append(
        RecordKind.OP,
        state=OpState.ENQUEUED if live else OpState.COMPLETED,
        op=OpCode.ALL_REDUCE,
        group=0,
        group_seq=i + 1,
        nbytes=7 * i,
        t_enqueue_ns=1000 + i,
        name=f"op{i}",
        live=live,
    )


def test_round_trip_and_header(tmp_path: Path) -> None:
    w = _writer(tmp_path / "j.journal")
    seq = _op(w, 0, live=True)
    r = JournalReader(tmp_path / "j.journal")
    assert (r.header.rank, r.header.world_size, r.header.local_rank) == (3, 8, 1)
    assert r.header.pid == os.getpid()
    rec = r.read(seq)
    assert rec is not None and rec.pending and rec.op == OpCode.ALL_REDUCE and rec.name == "op0"
    w.update(seq, OpState.COMPLETED, t_end_ns=5000)
    rec = r.read(seq)
    assert rec is not None and rec.state == OpState.COMPLETED and rec.t_end_ns == 5000
    assert rec.t_enqueue_ns == 1000


def test_state_block_tracks_steps_phases_and_close(tmp_path: Path) -> None:
    w = _writer(tmp_path / "j.journal")
    r = JournalReader(tmp_path / "j.journal")
    assert r.state().status == JournalStatus.RUNNING and r.state().step == 0
    w.step(5, t_ns=123)
    w.phase_begin("eval")
    st = r.state()
    assert (st.step, st.step_mono_ns, st.phase) == (5, 123, "eval")
    w.phase_begin("checkpoint")
    w.phase_end("checkpoint")
    assert r.state().phase == "eval"
    w.phase_end("eval")
    assert r.state().phase == ""
    w.close()
    assert r.state().status == JournalStatus.CLOSED
    kinds = [rec.kind for rec in r.tail(10)]
    assert kinds == [
        RecordKind.STEP,
        RecordKind.PHASE_BEGIN,
        RecordKind.PHASE_BEGIN,
        RecordKind.PHASE_END,
        RecordKind.PHASE_END,
    ]


def test_wrap_around_keeps_the_newest_capacity_records(tmp_path: Path) -> None:
    w = _writer(tmp_path / "j.journal", capacity=16)
    for i in range(100):
        _op(w, i)
    r = JournalReader(tmp_path / "j.journal")
    assert r.head() == 100
    assert r.read(83) is None  # overwritten by 99
    recs = r.read_range(0, 100)
    assert [x.seq for x in recs] == list(range(84, 100))
    assert all(x.nbytes == 7 * x.seq and x.name == f"op{x.seq}" for x in recs)


def test_update_of_a_reused_slot_does_not_clobber_the_new_record(tmp_path: Path) -> None:
    w = _writer(tmp_path / "j.journal", capacity=16)
    old = _op(w, 0, live=True)
    for i in range(1, 20):
        _op(w, i)
    w.update(old, OpState.COMPLETED, t_end_ns=1)  # its slot now holds seq 16
    r = JournalReader(tmp_path / "j.journal")
    rec = r.read(16)
    assert rec is not None and rec.name == "op16" and rec.state == OpState.COMPLETED


def test_a_half_written_slot_is_never_returned(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    w = _writer(path, capacity=16)
    for i in range(3):
        _op(w, i)
    r = JournalReader(path)
    off = HEADER_SIZE + 2 * SLOT_SIZE
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        # A writer that died between the two version stores: odd version, body half new.
        struct.pack_into("<Q", mm, off, 2 * 2 + 1)
        mm[off + 8 : off + 40] = b"\xff" * 32
        assert r.read(2) is None
        # A writer that died after the body but with a settled-looking version: crc catches it.
        struct.pack_into("<Q", mm, off, 2 * 2 + 2)
        assert r.read(2) is None
    assert [x.seq for x in r.read_range(0, 3)] == [0, 1]


def test_not_a_journal_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.journal"
    bad.write_bytes(b"x" * (HEADER_SIZE + 10))
    with pytest.raises(JournalFormatError, match="not an op journal"):
        JournalReader(bad)
    small = tmp_path / "small.journal"
    small.write_bytes(b"x")
    with pytest.raises(JournalFormatError, match="too small"):
        JournalReader(small)
    with pytest.raises(JournalFormatError, match="cannot open"):
        JournalReader(tmp_path / "missing.journal")


def test_new_incarnation_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    _writer(path)
    r = JournalReader(path)
    assert not r.replaced()
    _writer(path)  # a restarted rank creates its journal anew
    assert r.replaced()


def _write_forever(path: str, capacity: int, ready) -> None:
    w = JournalWriter(Path(path), rank=0, world_size=1, local_rank=0, capacity=capacity)
    ready.set()
    i = 0
    while True:
        seq = w.append(
            RecordKind.OP,
            state=OpState.ENQUEUED,
            op=OpCode.BROADCAST,
            flags=OpFlag.P2P,
            group_seq=i,
            nbytes=3 * i,
            name=f"n{i % 1000}",
            live=True,
        )
        w.update(seq, OpState.COMPLETED, t_end_ns=i + 1)
        i += 1


def _check_consistent(recs) -> None:
    for rec in recs:
        # Every field a record carries agrees with its own sequence number.
        assert rec.nbytes == 3 * rec.group_seq and rec.name == f"n{rec.group_seq % 1000}"
        assert rec.seq == rec.group_seq
        if rec.state == OpState.COMPLETED:
            assert rec.t_end_ns == rec.group_seq + 1
        else:
            assert rec.state == OpState.ENQUEUED and rec.t_end_ns == 0


def test_reader_racing_a_writer_in_another_process_sees_no_torn_record(tmp_path: Path) -> None:
    path = tmp_path / "race.journal"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_write_forever, args=(str(path), 64, ready), daemon=True)
    p.start()
    try:
        assert ready.wait(30)
        r = JournalReader(path)
        seen = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            recs = r.tail(64)
            _check_consistent(recs)
            seen += len(recs)
        assert seen > 1000 and r.head() > 64 * 10  # the ring wrapped many times under us
    finally:
        p.kill()
        p.join(10)


def test_writer_killed_mid_record_leaves_a_readable_journal(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    for attempt in range(5):
        path = tmp_path / f"killed{attempt}.journal"
        ready = ctx.Event()
        p = ctx.Process(target=_write_forever, args=(str(path), 32, ready), daemon=True)
        p.start()
        assert ready.wait(30)
        # Let the ring wrap a few times first (a loaded machine may start the writer slowly),
        # then kill at a moment that differs from attempt to attempt.
        watch = JournalReader(path)
        deadline = time.monotonic() + 30
        while watch.head() < 4 * 32 + 97 * attempt and time.monotonic() < deadline:
            time.sleep(0.005)
        watch.close()
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        r = JournalReader(path)
        head = r.head()
        recs = r.read_range(0, head + 1)  # +1: the slot being written when the kill came
        _check_consistent(recs)
        assert len(recs) >= 30  # at most the slot in flight (and its neighbour) is lost
        assert r.state().status == JournalStatus.RUNNING  # died without closing


def test_records_carry_the_native_id_of_the_thread_that_issued_them(tmp_path: Path) -> None:
    import threading

    w = _writer(tmp_path / "j.journal")
    main_seq = _op(w, 0)
    issued: dict[str, int] = {}

    def train() -> None:  # a training loop in a worker thread
        issued["seq"] = _op(w, 1, live=True)
        issued["tid"] = threading.get_native_id()

    t = threading.Thread(target=train)
    t.start()
    t.join(timeout=10)
    # completion is seen on another thread: the record still names the issuer
    done = threading.Thread(target=w.update, args=(issued["seq"], OpState.COMPLETED))
    done.start()
    done.join(timeout=10)
    r = JournalReader(tmp_path / "j.journal")
    assert r.version == 2
    first, second = r.read(main_seq), r.read(issued["seq"])
    assert first is not None and first.tid == threading.get_native_id()
    assert second is not None and second.state == OpState.COMPLETED
    assert second.tid == issued["tid"] != first.tid


_STATIC_V1 = struct.Struct("<8sIIIIiiiIIIQQ")
_BODY_V1 = struct.Struct("<BBHHHiiQQQQQQ48s")


def _version_1_journal(path: Path, version: int = 1) -> None:
    """A journal as a version-1 trainer wrote it: 120-byte slots bodies without the thread id,
    the crc at 120."""
    import zlib

    capacity = 16
    mm = bytearray(HEADER_SIZE + capacity * SLOT_SIZE)
    _STATIC_V1.pack_into(mm, 0, b"DIAGJRN1", version, HEADER_SIZE, SLOT_SIZE, capacity, 5, 8, 1,
                         4242, 0, 0, 1, 2)  # fmt: skip
    for seq in range(3):
        body = _BODY_V1.pack(RecordKind.OP, OpState.COMPLETED, OpCode.BROADCAST, 1, 0, 0, -1,
                             seq + 1, 64, 100 + seq, 0, 200 + seq, 7, b"v1")  # fmt: skip
        off = HEADER_SIZE + seq * SLOT_SIZE
        struct.pack_into("<Q", mm, off, 2 * seq + 2)
        mm[off + 8 : off + 8 + len(body)] = body
        struct.pack_into("<II", mm, off + 120, zlib.crc32(body, seq), 0)
    struct.pack_into("<Q", mm, 64, 3)
    path.write_bytes(bytes(mm))


def test_version_1_journals_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "old.journal"
    _version_1_journal(path)
    r = JournalReader(path)
    assert r.version == 1 and r.header.rank == 5 and r.head() == 3
    recs = r.tail(10)
    assert [(x.seq, x.op, x.group_seq, x.t_end_ns, x.step, x.name, x.tid) for x in recs] == [
        (s, OpCode.BROADCAST, s + 1, 200 + s, 7, "v1", 0) for s in range(3)
    ]


def test_an_unknown_journal_version_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "new.journal"
    _version_1_journal(path, version=9)
    with pytest.raises(JournalFormatError, match=r"version 9 .* reads versions 1 and 2"):
        JournalReader(path)
