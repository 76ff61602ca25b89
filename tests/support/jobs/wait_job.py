"""A small gloo job that loops collectives or point-to-point ops and gets stuck on purpose, for the
end-to-end tests of wait-for cycles and of jobs that never mark a step. One process per rank:

    torchrun --nproc-per-node 4 tests/support/jobs/wait_job.py --scenario groups --fault-rank 1 --fault-step 6

Scenarios (the fault happens on `--fault-rank` at `--fault-step`):
  groups    two groups with the same members; each step all-reduces on the first, then on the
            second. At the fault step the fault rank takes the second group first (after
            `--fault-delay` seconds, so that the others are inside the first before it): a
            deadlock across groups.
  p2p       ranks exchange with a partner (pairs 0-1, 2-3...): the lower rank sends then receives,
            the higher receives then sends; then an all-reduce. At the fault step the fault rank
            receives first: both partners wait in recv from each other.
  pipeline  one stage per rank: forward activations go up (recv from i-1, send to i+1), gradients
            come back down (recv from i+1, send to i-1). At the fault step the fault stage waits
            for its gradient before it sends its activation on: it and the next stage wait on
            each other; the stages before and after wait on them.
  stepless  all-reduces in a loop, and never a step boundary (`attach()` without an engine and no
            `diag.trainer.step()`). After `--fault-after` seconds the fault rank stops issuing
            collectives (it sleeps): the others wait for it.
  leaver    an all-reduce per step; at the fault step the fault rank's data has run out: it
            leaves its loop and exits 0, and the others go on to the next all-reduce (gloo: the
            connection closes and they fail).
  leaver-hang  the same, but a process forked by the fault rank (as a data-loader worker would
            be) holds its connections open: the others wait in the all-reduce for ever.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time

SCENARIOS = ("groups", "p2p", "pipeline", "stepless", "leaver", "leaver-hang")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=6)
    p.add_argument("--fault-after", type=float, default=40.0, help="stepless: seconds")
    p.add_argument("--fault-delay", type=float, default=0.0, help="groups: seconds")
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="gloo collective timeout, s")
    return p.parse_args()


def log(msg: str) -> None:
    print(f"wait_job rank {os.environ.get('RANK')}: {msg} at {time.time():.3f}", flush=True)


def _hold_connections() -> None:
    """A child that keeps this rank's sockets open until the launcher is gone (at most 150 s),
    so that its peers' collectives never complete instead of failing."""
    launcher = os.getppid()
    if os.fork() == 0:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        os._exit(0)


def main() -> int:
    args = parse()
    import torch
    import torch.distributed as dist

    import diag.trainer

    timeout = dt.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("gloo", timeout=timeout)
    diag.trainer.attach()
    rank, world = dist.get_rank(), dist.get_world_size()
    other = dist.new_group(list(range(world)), timeout=timeout)
    x = torch.ones(256)
    fault = rank == args.fault_rank
    started = time.monotonic()

    def exchange(partner: int, send_first: bool) -> None:
        if send_first:
            dist.send(x, partner)
            dist.recv(x, partner)
        else:
            dist.recv(x, partner)
            dist.send(x, partner)

    for step in range(1, args.steps + 1):
        at_fault = step == args.fault_step
        if args.scenario == "groups":
            first, second = (other, None) if at_fault and fault else (None, other)
            if at_fault:
                log("fault step")
                if fault:
                    time.sleep(args.fault_delay)
            dist.all_reduce(x, group=first)
            dist.all_reduce(x, group=second)
        elif args.scenario == "p2p":
            partner = rank ^ 1
            send_first = rank < partner and not (at_fault and fault)
            if at_fault and fault:
                log("receiving first")
            exchange(partner, send_first)
            dist.all_reduce(x)
        elif args.scenario.startswith("leaver"):
            if at_fault and fault:
                log("its data ran out: leaves the loop and exits 0")
                if args.scenario == "leaver-hang":
                    _hold_connections()
                return 0
            dist.all_reduce(x)
        elif args.scenario == "pipeline":
            if at_fault and fault:
                log("waiting for the gradient before sending the activation")
                dist.recv(x, rank + 1)
            if rank > 0:
                dist.recv(x, rank - 1)  # forward activation
            if rank < world - 1:
                dist.send(x, rank + 1)
                if not (at_fault and fault):
                    dist.recv(x, rank + 1)  # gradient
            if rank > 0:
                dist.send(x, rank - 1)
        else:  # stepless
            if fault and time.monotonic() - started > args.fault_after:
                log("stops issuing collectives")
                time.sleep(3600)
            dist.all_reduce(x)
            dist.all_reduce(x)
        x.fill_(1.0)
        if args.scenario != "stepless":
            diag.trainer.step(step)
        time.sleep(args.step_seconds)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
