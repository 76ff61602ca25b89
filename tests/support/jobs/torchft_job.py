"""The goodput bench's job (tests/support/jobs/goodput_job.py) under torchft: the same model
(dsengine's `tiny_model`), data per step and rank, Adam and lr, trained by one replica group per
node that torchft's `Manager` keeps in step with the other groups through its lighthouse.

    torchrun --standalone --nproc-per-node 2 ... tests/support/jobs/torchft_job.py --group G \
        --lighthouse http://127.0.0.1:P --out O --faults F [--steps 60] [--hidden 64]

The ranks of one launcher are one replica group (torchft's layout: global rank = group x group
size + the rank in the group; the Manager's cross-group process group joins rank r of every group).
A step: the gradient averaged inside the group (a plain gloo group of the launcher's ranks), then
across the groups in the quorum with `Manager.allreduce`; the optimizer steps only when
`should_commit` says every rank of the group got through, so the Manager's step counts committed
steps. A group that comes back (its launcher restarts it, or the node returns) heals: it takes the
weights and optimizer state of a group in the quorum over torchft's checkpoint transport, at the
quorum's newest step.

Timeouts: --pg-timeout (60 s, as the other stacks) for the in-group gloo group, the Manager's
collectives, its RPCs and the checkpoint transfer; --quorum-timeout (120 s) for a quorum: a healthy
group waits there while the lighthouse still sees a broken group heartbeating (its rank 0 alive,
stuck in the in-group collective up to --pg-timeout, then 5 s of heartbeat timeout), and a quorum
that times out ends the healthy group's ranks too.

Faults and events: as goodput_job.py (its `_due`, `_fire`, `Events` and `begin`), each `step` event
also with `replicas`, the groups that took part in the step. The healthy group trains on while a
failed one restarts, so the returning group heals past steps: a rank fault of a step it skipped
fires at its first step after it (the `fault` event has the step it fired at), and only once the
process has committed a step with every group (so one fault's recovery is over before the next
fires). A group waits for the others at the start (as the other stacks' rendezvous waits for both
nodes) and, having trained the last step, until they are back and healed from it (--wait-groups).
"""

from __future__ import annotations

import time

T_START = time.time()  # before the imports: a restart pays them

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from goodput_job import Events, _due, _fire, begin  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True, help="this launcher's replica group")
    p.add_argument("--lighthouse", required=True, help="torchft lighthouse, http://host:port")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument("--faults", default="", help="JSON file of faults this job injects itself")
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--quorum-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--groups", type=int, default=2, help="replica groups of the whole job")
    p.add_argument(
        "--wait-groups", type=float, default=120.0,
        help="s a group waits for the others at the job's start and end",
    )  # fmt: skip
    return p.parse_args(argv)


def _wait_groups(manager: Any, args: argparse.Namespace) -> None:
    """Quorums until every group is in one (or --wait-groups passes), then a collective across
    them: a group that healed in that quorum has its state by then, and the group it healed
    from may leave."""
    import torch

    deadline = time.monotonic() + args.wait_groups
    while manager.num_participants() < args.groups and time.monotonic() < deadline:
        time.sleep(0.2)
        manager.start_quorum()
    if manager.num_participants() >= args.groups:
        manager.allreduce(torch.zeros(1)).wait()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out, node = begin(args.out, T_START)
    import torch
    import torch.distributed as dist
    from dsengine import tiny_model
    from torchft import Manager, ProcessGroupGloo

    timeout = datetime.timedelta(seconds=args.pg_timeout)
    # The group's own ranks: its rank 0 hosts the store the Manager meets in too.
    dist.init_process_group("gloo", timeout=timeout)
    local, size = dist.get_rank(), dist.get_world_size()
    rank = args.group * size + local
    ev = Events(out, pid=os.getpid(), node=node, rank=rank)
    faults = json.loads(Path(args.faults).read_text()) if args.faults else []
    torch.manual_seed(args.seed)  # every group starts from the same weights: no sync at step 0
    h = args.hidden
    model = tiny_model(h)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    # Made last: its rank 0 heartbeats to the lighthouse from here on, and a group that
    # heartbeats but has not joined holds back the other group's quorum (torchft's split-brain
    # rule with two groups).
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,  # heal before the forward: the restored step is known there
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout),
        connect_timeout=timeout,
        rank=local,
        world_size=size,
        lighthouse_addr=args.lighthouse,
        replica_id=f"goodput_{args.group}",  # torchft reads the group from the trailing digits
        init_sync=False,
    )
    ev("ready")
    manager.start_quorum()
    # The job starts with every group, as the other stacks' rendezvous waits for both nodes: a
    # group first at the lighthouse would otherwise train alone until the other joins.
    if manager.current_step() == 0:
        _wait_groups(manager, args)
    start = manager.current_step()
    # Nothing is on storage here: a group past step 0 at its first quorum healed from a peer.
    ev("restored", step=start, source="peer" if start else "")
    # Faults wait for the job to be whole: a step committed by every group since this process
    # started (as the harness's node faults wait for a step of the returning node).
    whole = False
    first = True
    while True:
        t0 = time.time()
        if not first:
            manager.start_quorum()
        first = False
        step = manager.current_step() + 1
        if step > args.steps:
            break
        # A fault of a step this group healed past fires at its first step after it.
        due = [dict(f, step=step) for f in faults if f["step"] <= step]
        fault = _due(due, out, rank, step) if whole else None
        if fault is not None:
            ev("fault", id=fault["id"], kind=fault["kind"], step=step)
            _fire(fault["kind"])
        gen = torch.Generator().manual_seed(args.seed * 100003 + step * 10 + rank)
        x = torch.randn(4, h, generator=gen)
        opt.zero_grad()
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        dist.all_reduce(flat)  # a dead or stuck peer in the group raises here: the group restarts
        flat /= size
        # Across the groups: an error here is kept by the Manager and the step is not committed.
        manager.allreduce(flat).wait()
        at = 0
        for p in params:
            if p.grad is not None:
                n = p.grad.numel()
                p.grad.copy_(flat[at : at + n].view_as(p.grad))
                at += n
        if manager.should_commit():
            opt.step()
            whole = whole or manager.num_participants() >= args.groups
            ev(
                "step", step=manager.current_step(), t0=t0, t=time.time(),
                replicas=manager.num_participants(),
            )  # fmt: skip
    # A group that finished waits for the others: one that is coming back heals to the last step
    # from it (and would train from nothing alone, with no group left to heal from).
    _wait_groups(manager, args)
    ev("done")
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from diag.trainer import exit_process

    exit_process(main())
