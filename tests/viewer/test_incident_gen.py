"""The production-shaped incident generator writes what its truth file says, in all formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from incidentkit import gen

from diag.formats.stackdump import RankDump
from diag.proto import hosting_service_pb2


@pytest.mark.parametrize("fmt", ["diag", "xpu", "pyspy", "mixed"])
def test_generated_files_match_the_truth(tmp_path: Path, fmt: str) -> None:
    truth = gen.write_incident(tmp_path, gen.plan_incident(64, fmt=fmt, seed=3))
    again = gen.Truth.load(tmp_path)
    assert again == truth
    names = {p.name for p in tmp_path.iterdir()} - {gen.TRUTH_FILE}
    ranks = {int(n[:5]) for n in names}
    assert ranks == set(range(64)) - set(truth.missing_ranks)
    # a whole node is gone, plus scattered ranks
    (node,) = truth.missing_nodes
    assert set(truth.node_ranks(node)) <= set(truth.missing_ranks)
    assert len(truth.missing_ranks) == 8 + 2
    assert len(truth.odd_ranks) == 1 and not set(truth.odd_ranks) & set(truth.unanswered)
    assert truth.python_threads == 15 and 55 <= truth.native_threads <= 65
    assert 180 <= truth.deepest_native <= 210
    assert sum(truth.formats.values()) == len(names)
    for name in sorted(names):
        rank = int(name[:5])
        data = (tmp_path / name).read_bytes()
        corrupt = rank in truth.corrupt_ranks
        if name.endswith(".stacktrace"):
            st = hosting_service_pb2.Stacktrace()
            if corrupt:
                with pytest.raises(DecodeError):
                    st.ParseFromString(data)
                continue
            st.ParseFromString(data)
            if rank in truth.timed_out_ranks:
                assert not st.stacktrace and "timed out" in st.pyspy_stderr
                continue
            assert len(st.py_stacktrace) == truth.python_threads + _feeder_delta(truth, rank)
            if rank not in truth.odd_ranks:
                assert max(len(t.frames) for t in st.stacktrace) >= 180
            assert any(f.func_name == "??" for t in st.stacktrace for f in t.frames)
        elif name.endswith(".stack.json"):
            if corrupt:
                with pytest.raises(ValueError):
                    json.loads(data)
                continue
            d = RankDump.from_dict(json.loads(data))
            assert (d.rank, d.world_size) == (rank, 64)
            if rank in truth.timed_out_ranks:
                assert d.error and not d.threads
                continue
            assert d.node == f"node-{rank // 8:04d}" and d.local_rank == rank % 8
            assert len(d.threads) == truth.python_threads + _feeder_delta(truth, rank)
            assert len(d.native_threads) == truth.native_threads + _feeder_delta(truth, rank)
        else:
            if corrupt:
                with pytest.raises(ValueError):
                    json.loads(data)
                continue
            raw = json.loads(data)
            if rank in truth.timed_out_ranks:
                assert raw == []
                continue
            assert {t["thread_name"] for t in raw} >= {"MainThread", "QueueFeederThread"}
            frames = [f for t in raw for f in t["frames"]]
            assert any(f["name"].startswith("0x") for f in frames)  # unresolved native frames
            assert any(f["line"] == 0 and f["module"] for f in frames)


def _feeder_delta(truth, rank: int) -> int:
    return (rank in truth.extra_feeder_ranks) - (rank in truth.fewer_feeder_ranks)


def test_thread_counters_vary_by_rank(tmp_path: Path) -> None:
    truth = gen.write_incident(tmp_path, gen.plan_incident(64, fmt="diag", seed=5, corrupt=0))
    names: dict[str, set[int]] = {}
    for p in tmp_path.glob("*.stack.json"):
        d = RankDump.load(p)
        for t in d.threads:
            if "_pin_memory_loop" in t.name:
                names.setdefault(t.name, set()).add(d.rank)
    assert len(names) >= 2, names  # Thread-8 on most ranks, Thread-9 or Thread-13 on others
    assert 0 < truth.renumbered_ranks < 64


def test_agree_scenario_has_no_odd_rank(tmp_path: Path) -> None:
    truth = gen.plan_incident(1344, scenario="agree", seed=2)
    assert not truth.odd_ranks and truth.missing_nodes
    with pytest.raises(ValueError, match="multiple"):
        gen.plan_incident(100, local=8)
