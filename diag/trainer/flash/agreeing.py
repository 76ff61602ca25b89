"""What the ranks of a flash checkpointer agree on together, each in one collective over the
checkpointer's CPU group: whether every rank can save, the replication rounds, the launch, which
ranks keep a node-local copy of the model states."""

from __future__ import annotations

from typing import Any

from diag.trainer.flash.replicarounds import Agreed, Vote
from diag.trainer.flash.resume import WriterFacts, replica_ranks
from diag.trainer.flash.slots import SlotOwner


def everyone(ok: bool, group: Any, world_size: int) -> bool:
    """True when `ok` holds on every rank (collective)."""
    if world_size <= 1:
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def agree_save(votes: tuple[bool, Vote], group: Any, world_size: int) -> tuple[bool, Agreed]:
    """(every rank got a slot, the rounds' agreement): one all-reduce over `group`."""
    got, v = votes
    flags = [int(got), int(v.ready), -int(v.replicating), -int(v.abandon)]
    if world_size > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        flags = [int(x) for x in t.tolist()]
    return bool(flags[0]), Agreed(bool(flags[1]), flags[2] < 0, flags[3] < 0)


def launch_id(node: str, owner: SlotOwner, group: Any, world_size: int) -> str:
    """This launch of the job, the same on every rank: the agent commits a step only from
    parts of one launch (collective)."""
    mine = [f"{node}:{owner.pid}:{owner.start_time:.3f}"]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(mine, src=0, group=group)
    return str(mine[0])


def plan_replicas(
    engine: Any, rank: int, node: str, local_rank: int, world_size: int, group: Any
) -> set[int]:
    """The ranks that keep a node-local copy of the model states (resume.replica_ranks), from
    every rank's facts (collective)."""
    import torch.distributed as dist

    mine = WriterFacts(
        rank,
        node,
        local_rank,
        int(getattr(engine, "checkpoint_mp_rank", 0) or 0),
        bool(engine.save_non_zero_checkpoint),
    )
    facts: list[Any] = [None] * world_size
    dist.all_gather_object(facts, mine, group=group)
    return replica_ranks(facts)
