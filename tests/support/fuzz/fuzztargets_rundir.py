"""Fuzz targets of the run directory: a journal's meta, read the way the agent's observer reads
it (and then watched for a poll), and the journal ring itself (header, state block, records),
read by the JournalReader and turned into the evidence's journal tail."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import psutil
from fuzzkit import FuzzTarget

from diag.agent.evidence.collection import journal_tail_document
from diag.agent.observe.observer import Observer
from diag.formats.journal import JournalFormatError
from diag.formats.journalmeta import GroupInfo, JournalMeta, journal_path, read_meta
from diag.formats.journalreader import JournalReader
from diag.formats.journalwriter import JournalWriter
from diag.formats.records import DType, OpCode, OpFlag, OpState, RecordKind
from diag.formats.untrusted import Owners

_JOB = "fuzz"
_WRITERS: list[JournalWriter] = []  # kept open (mapped) for the fuzzing process's lifetime


def _writer(directory: Path, capacity: int = 16) -> JournalWriter:
    w = JournalWriter(
        journal_path(directory, _JOB, 0), rank=0, world_size=2, local_rank=0, capacity=capacity
    )
    _WRITERS.append(w)
    w.phase_begin("train")
    for step in range(1, 4):
        seq = w.append_op(OpCode.ALL_REDUCE, DType.FLOAT32, OpFlag.NONE, 0, -1, step, 4096, 1)
        w.update(seq, OpState.COMPLETED, t_start_ns=2, t_end_ns=3)
        w.step(step)
    w.append_op(OpCode.ALL_REDUCE, DType.BFLOAT16, OpFlag.NONE, 0, -1, 4, 4096, 5)  # pending
    w.append(RecordKind.MARK, name="mark")
    return w


def _meta(**over: object) -> JournalMeta:
    fields: dict = dict(
        job=_JOB, rank=0, world_size=2, local_rank=0, local_world_size=2, pid=os.getpid(),
        pid_start_time=psutil.Process().create_time(), node="n", launcher="torchrun",
        pg_timeout_s=600.0, groups=(GroupInfo(0, "default_pg", (0, 1), "gloo", "", 600.0),),
        own_threads=(os.getpid(),),
    )  # fmt: skip
    fields.update(over)
    return JournalMeta(**fields)


def _meta_seeds(scratch: Path) -> list[bytes]:
    _writer(scratch)  # the journal the meta belongs to, mapped by this process: a proven rank
    return [
        _meta().to_json().encode(),
        _meta(groups=(), own_threads=(), pid_ns=0).to_json().encode(),
    ]


def _parse_meta(path: Path) -> object:
    journal = journal_path(path.parent, _JOB, 0)
    owners = Owners.this_process()
    obs = Observer(path.parent, owners=owners)
    quiet = logging.getLogger(
        "diag.agent.observe.observer"
    )  # one warning per refused meta: 100,000s
    quiet.disabled = True
    try:
        obs.observe(time.monotonic())  # the agent's read path: refused metas are only warned of
    finally:
        quiet.disabled = False
        obs.close()
    return read_meta(journal, owners)


def _ring_seeds(scratch: Path) -> list[bytes]:
    ring = scratch / "seed"
    ring.mkdir(exist_ok=True)
    w = _writer(ring)
    w.close()
    data = journal_path(ring, _JOB, 0).read_bytes()
    return [data]


def _parse_ring(path: Path) -> object:
    reader = JournalReader(path, owners=Owners.this_process())
    try:
        reader.state()
        records = reader.tail(reader.header.capacity)
    finally:
        reader.close()
    journal_tail_document(path, time.monotonic(), 64, Owners.this_process())
    return records


TARGETS = [
    FuzzTarget(
        "journal_meta",
        _meta_seeds,
        _parse_meta,
        file_name=f"{_JOB}-rank00000.meta.json",
        json=True,
    ),
    FuzzTarget(
        "journal_ring",
        _ring_seeds,
        _parse_ring,
        refusals=(JournalFormatError,),
        file_name="ring.journal",
    ),
]
