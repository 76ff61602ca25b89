"""Resuming a job from its flash checkpoints: the same step on every rank, even when a slot fails.

Every rank contributes what it holds (resume.RankFacts), and all decide the same plan on the
same facts (resume.plan_resume). For a step in memory each rank then reads and unpickles its
files of that step (restore.stage) before DeepSpeed's load runs any collective, and the ranks
agree whether all of them could: if one could not (a refused pickle, a rebuild that raised,
anything), its slot of that step is discarded and every rank plans again without the step, so
they resume together from an older one or from storage. No rank fails alone in the middle of
DeepSpeed's load, leaving the others waiting in a collective, and no restart meets the same slot
again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from diag.formats.snapshot import read_latest_step, step_tag
from diag.trainer.elastic import reshard
from diag.trainer.flash.restore import (
    FileIndex,
    FlashCheckpointError,
    LoadFailure,
    Place,
    load_from_memory,
    memory_index,
    needed_files,
    stage,
    wait_for_writing,
)
from diag.trainer.flash.resume import (
    RankFacts,
    ResumePlan,
    Source,
    fell_back,
    held_text,
    plan_resume,
)
from diag.trainer.flash.slots import RankSlots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    plan: ResumePlan
    client_state: Any = None
    resharded_from: int | None = None  # data-parallel size of the step loaded, when it differed
    reshard_seconds: float = 0.0
    fell_back: bool = False  # from storage although every rank held a step as new in memory
    held: str = ""  # which steps each rank held in memory (resume.held_text)


def resume(
    engine: Any,
    place: Place,
    group: Any,
    slots: RankSlots,
    everyone: Callable[[bool], bool],
) -> Resumed:
    """Loads the newest step every rank can load: from memory, else from storage (collective)."""
    import torch.distributed as dist

    def needed(tag: str) -> set[str]:
        return needed_files(engine, place.save_dir, tag)

    index = memory_index(place, needed)
    if not index:  # from storage, unless another rank's memory says otherwise
        wait_for_writing(place)
    dist.barrier(group=group)  # `latest` read once every rank's wait is over
    facts = RankFacts(place.rank, tuple(index), read_latest_step(place.save_dir))
    gathered: list[Any] = [None] * place.world_size
    dist.all_gather_object(gathered, facts, group=group)
    left_out: set[int] = set()
    while True:
        plan = plan_resume(gathered, frozenset(left_out))
        log.info("diag: resume plan: %s (%s)", plan.source.value, plan.reason)
        if plan.source != Source.MEMORY or plan.step is None:
            staged = None
            break
        got = stage(place, plan.step, index[plan.step], needed(step_tag(plan.step)))
        if isinstance(got, LoadFailure) and got.slot in slots.paths:
            slots.discard(plan.step)
        if everyone(not isinstance(got, LoadFailure)):
            assert not isinstance(got, LoadFailure)
            staged = got
            break
        left_out.add(plan.step)  # a rank could not read it: every rank leaves it out
    held = held_text(gathered)
    fallback = fell_back(plan, gathered)
    if fallback and place.rank == 0:
        log.warning(
            "diag: resuming from %s, not from memory, although ranks held steps in memory: %s "
            "(held: %s)",
            f"storage step {plan.step}" if plan.step is not None else "nothing", plan.reason, held,
        )  # fmt: skip
    got = _load(engine, place, plan, slots, index, staged)
    return replace(got, fell_back=fallback, held=held)


def _load(
    engine: Any,
    place: Place,
    plan: ResumePlan,
    slots: RankSlots,
    index: dict[int, FileIndex],
    staged: dict[str, Any] | None,
) -> Resumed:
    stale = slots.discard_newer(plan.step)
    if stale:
        log.info(
            "diag: snapshots newer than the resumed step %s discarded from slots %s",
            plan.step, stale,
        )  # fmt: skip
    if plan.source == Source.NONE or plan.step is None:
        return Resumed(plan)
    tag = step_tag(plan.step)
    resharded_from, seconds = None, 0.0
    if plan.source == Source.STORAGE:
        # Through a universal checkpoint when the step was saved at another data-parallel
        # size (snapshots in memory are per partition: at another size there are none).
        result = reshard.load(engine, place.save_dir, tag)
        path, client_state = result.path, result.client_state
        if result.verdict.resharded:
            resharded_from, seconds = result.verdict.saved_dp, result.verdict.seconds
    else:
        assert staged is not None
        path, client_state = load_from_memory(engine, place, plan.step, index[plan.step], staged)
    if path is None:
        raise FlashCheckpointError(f"DeepSpeed could not load step {plan.step} ({plan.reason})")
    return Resumed(plan, client_state, resharded_from, seconds)
