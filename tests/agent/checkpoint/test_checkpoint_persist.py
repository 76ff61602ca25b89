"""The agent's persist path without DeepSpeed: snapshot -> torch.save-format files, done markers,
the `latest` commit across ranks written by different agents, keep-last-N, and the pure rules."""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from snapshot_helpers import captured, model_states, new_slot, write_snapshot

from diag.agent.checkpoint.persist import persist_slot
from diag.agent.checkpoint.storage import (
    done_ranks,
    marker_path,
    prune_plan,
    should_commit,
)
from diag.formats.snapshot import read_latest_step
from diag.trainer.flash.capture import unpickle_state
from diag.trainer.flash.resume import (
    RankFacts,
    Source,
    WriterFacts,
    plan_resume,
    replica_ranks,
)


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-persist-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_persisted_files_load_with_torch(run_dir: Path, tmp_path: Path) -> None:
    state = model_states(5)
    state["view"] = torch.arange(100.0)[10:20]  # a view: its whole storage is saved, as torch does
    state["shared"] = [state["module"]["w"], state["module"]["w"]]
    files = captured({"global_step5/mp_rank_00_model_states.pt": state}, {"zero_to_fp32.py": b"#!"})
    slot = new_slot(run_dir, "j", 0, 0)
    write_snapshot(slot, 5, files, job="j", rank=0, world=1, save_dir=tmp_path)
    # what load() from memory reconstructs
    meta = slot.meta()
    entry = meta.files[0]
    spans = {s.key: s for s in entry.storages}
    assert entry.pickle is not None
    again = unpickle_state(
        slot.view(entry.pickle.offset, entry.pickle.length),
        lambda k: slot.view(spans[k].offset, spans[k].nbytes),
        storages={k: s.nbytes for k, s in spans.items()},
        budget=slot.capacity,
    )
    assert _equal(again, state)
    slot.close()

    result = persist_slot(slot.path, step=5)
    assert result.ok and result.committed and not result.skipped, result
    path = tmp_path / "global_step5" / "mp_rank_00_model_states.pt"
    assert zipfile.ZipFile(path).testzip() is None, "CRCs are right"
    loaded = torch.load(path, weights_only=False)
    assert _equal(loaded, state)
    assert loaded["shared"][0] is loaded["shared"][1], "shared storages stay shared"
    assert torch.load(path, weights_only=False, mmap=True)["module"]["w"].shape == (64, 32)
    assert (tmp_path / "zero_to_fp32.py").read_bytes() == b"#!"
    assert (tmp_path / "latest").read_text() == "global_step5"
    assert (tmp_path / "dlrover_latest.txt").read_text() == "5"
    again = persist_slot(slot.path, step=5)
    assert again.ok and again.skipped, "a step already on storage is not written twice"
    refused = persist_slot(slot.path, step=6)
    assert not refused.ok and "holds step 5" in refused.error


def test_commit_waits_for_every_rank_and_keeps_last_n(run_dir: Path, tmp_path: Path) -> None:
    world = 2
    slots = {r: new_slot(run_dir, "j", r, 0, world) for r in range(world)}
    for step in (1, 2, 3, 4):
        for rank, slot in slots.items():
            files = captured(
                {f"global_step{step}/zero_pp_rank_{rank}_optim.pt": model_states(step)}
            )
            write_snapshot(
                slot, step, files, job="j", rank=rank, world=world, save_dir=tmp_path,
                node=f"node-{rank}",
            )  # fmt: skip
        # Rank 1's agent (another node) is slower: nothing is committed after rank 0 alone.
        first = persist_slot(slots[0].path, step=step, keep=2)
        assert first.ok and not first.committed
        assert read_latest_step(tmp_path) == (step - 1 if step > 1 else None)
        second = persist_slot(slots[1].path, step=step, keep=2)
        assert second.ok and second.committed
        assert read_latest_step(tmp_path) == step
        assert done_ranks(tmp_path, step) == {0, 1}
    kept = sorted(p.name for p in tmp_path.glob("global_step*"))
    assert kept == ["global_step3", "global_step4"]
    assert not marker_path(tmp_path, 2, 0).exists()
    for slot in slots.values():
        slot.close()


def test_parts_of_one_step_from_two_launches_never_commit(run_dir: Path, tmp_path: Path) -> None:
    """Launch A dies after rank 0's part of step 5 reached storage but before rank 1 finished
    copying it; launch B resumes from step 4 and saves step 5 again. B's rank 1 part must not
    complete A's step: B's rank 0 part replaces A's first."""
    world = 2
    slots = {r: new_slot(run_dir, "j", r, 0, world) for r in range(world)}

    def save(rank: int, run: str, seed: int) -> None:
        files = captured({f"global_step5/zero_pp_rank_{rank}_optim.pt": model_states(5, seed)})
        write_snapshot(
            slots[rank], 5, files, job="j", rank=rank, world=world, save_dir=tmp_path, run=run
        )

    save(0, "launch-a", seed=1)
    assert persist_slot(slots[0].path, step=5).ok
    save(1, "launch-b", seed=2)
    second = persist_slot(slots[1].path, step=5)
    assert second.ok and not second.committed
    assert read_latest_step(tmp_path) is None, "a step mixed from two launches was committed"
    save(0, "launch-b", seed=2)
    third = persist_slot(slots[0].path, step=5)
    assert third.ok and not third.skipped and third.committed
    assert read_latest_step(tmp_path) == 5
    part = torch.load(tmp_path / "global_step5/zero_pp_rank_0_optim.pt", weights_only=False)
    assert torch.equal(part["module"]["w"], model_states(5, 2)["module"]["w"])
    for slot in slots.values():
        slot.close()


def test_commit_removes_what_a_killed_committer_left(run_dir: Path, tmp_path: Path) -> None:
    slot = new_slot(run_dir, "j", 0, 0, 1)
    files = captured({"global_step3/zero_pp_rank_0_optim.pt": model_states(3)})
    write_snapshot(slot, 3, files, job="j", rank=0, world=1, save_dir=tmp_path)
    tmp_path.mkdir(exist_ok=True)
    left = [tmp_path / ".latest.tmp-123-456-abcd", tmp_path / ".dlrover_latest.txt.tmp-1-2-ef"]
    for p in left:
        p.write_text("global_step2")
    assert persist_slot(slot.path, step=3).committed
    assert not any(p.exists() for p in left)
    assert read_latest_step(tmp_path) == 3
    slot.close()


@pytest.mark.parametrize(
    ("step", "world", "done", "latest", "expected"),
    [
        (5, 2, {0, 1}, None, True),
        (5, 2, {0}, None, False),
        (5, 2, {0, 1}, 5, False),  # already committed
        (5, 2, {0, 1}, 7, False),  # never backwards
        (8, 3, {0, 1, 2, 3}, 7, True),
        (8, 0, set(), None, False),
    ],
)
def test_should_commit(
    step: int, world: int, done: set[int], latest: int | None, expected: bool
) -> None:
    assert should_commit(step, world, done, latest) == expected


@pytest.mark.parametrize(
    ("steps", "committed", "keep", "expected"),
    [
        ([1, 2, 3, 4], 4, 2, [1, 2]),
        ([1, 2, 3, 4, 5], 3, 2, [1]),  # 4 and 5 may still be in progress elsewhere
        ([1, 2, 3], 3, 0, []),  # keep everything
        ([1, 2, 3], None, 1, []),
        ([10], 10, 1, []),
    ],
)
def test_prune_plan(
    steps: list[int], committed: int | None, keep: int, expected: list[int]
) -> None:
    assert prune_plan(steps, committed, keep) == expected


def _facts(*ranks: tuple[tuple[int, ...], int | None]) -> list[RankFacts]:
    return [RankFacts(i, mem, sto) for i, (mem, sto) in enumerate(ranks)]


@pytest.mark.parametrize(
    ("facts", "source", "step"),
    [
        (_facts(((), None), ((), None)), Source.NONE, None),
        (_facts(((4, 5), None), ((4, 5), None)), Source.MEMORY, 5),
        # rank 1 died in the middle of copying step 5: every rank still has step 4
        (_facts(((4, 5), None), ((4,), None)), Source.MEMORY, 4),
        (_facts(((4, 5), 6), ((4, 5), 6)), Source.STORAGE, 6),
        (_facts(((6,), 6), ((6,), 6)), Source.MEMORY, 6),  # a tie: memory is faster
        (_facts(((4, 5), 3), ((), 3)), Source.STORAGE, 3),  # a replaced node has no memory
        (_facts(((4,), 3), ((4,), None)), Source.MEMORY, 4),
        (_facts(((), 3), ((), None)), Source.NONE, None),  # storage unseen by one rank
    ],
)
def test_plan_resume(facts: list[RankFacts], source: Source, step: int | None) -> None:
    plan = plan_resume(facts)
    assert (plan.source, plan.step) == (source, step), plan.reason


@pytest.mark.parametrize(
    ("facts", "left_out", "source", "step"),
    [
        # a rank could not load step 5: every rank takes step 4 from memory
        (_facts(((4, 5), 3), ((4, 5), 3)), {5}, Source.MEMORY, 4),
        # nor step 4: storage's step 3
        (_facts(((4, 5), 3), ((4, 5), 3)), {4, 5}, Source.STORAGE, 3),
        # storage holds the failed step too: it is loaded from there
        (_facts(((5,), 5), ((5,), 5)), {5}, Source.STORAGE, 5),
        (_facts(((5,), None), ((5,), None)), {5}, Source.NONE, None),
        (_facts(((4, 5), None), ((4, 5), None)), {3}, Source.MEMORY, 5),  # not held: no effect
    ],
)
def test_plan_resume_without_steps_that_failed_to_load(
    facts: list[RankFacts], left_out: set[int], source: Source, step: int | None
) -> None:
    plan = plan_resume(facts, frozenset(left_out))
    assert (plan.source, plan.step) == (source, step), plan.reason
    failed = sorted(left_out & set(facts[0].memory_steps))
    assert ("failed to load from memory" in plan.reason) == bool(failed), plan.reason


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        # ZeRO 1/2 on one node: rank 0 writes the model file, nobody needs a copy
        ([WriterFacts(0, "a", 0, 0, True), WriterFacts(1, "a", 1, 0, False)], set()),
        # two nodes: node b has no writer, its first local rank keeps a copy
        (
            [
                WriterFacts(0, "a", 0, 0, True),
                WriterFacts(1, "a", 1, 0, False),
                WriterFacts(2, "b", 0, 0, False),
                WriterFacts(3, "b", 1, 0, False),
            ],
            {2},
        ),
        # tensor parallel over two local ranks: each mp rank has its own writer per node
        (
            [
                WriterFacts(0, "a", 0, 0, True),
                WriterFacts(1, "a", 1, 1, True),
                WriterFacts(2, "b", 0, 0, False),
                WriterFacts(3, "b", 1, 1, False),
            ],
            {2, 3},
        ),
        # ZeRO 3: everybody writes
        ([WriterFacts(0, "a", 0, 0, True), WriterFacts(1, "b", 0, 0, True)], set()),
    ],
)
def test_replica_ranks(facts: list[WriterFacts], expected: set[int]) -> None:
    assert replica_ranks(facts) == expected
