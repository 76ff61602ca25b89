"""Reference for bench/precheck_bench.py: the simplest network check there is, one gloo
allreduce over all nodes at once (what an nccl-tests run across the job measures). It gives one
busbw for the whole job and cannot say which node is slow or dead.

Usage (one process per node): allreduce_baseline.py MASTER_ADDR PORT NNODES RANK BIND_ADDR
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    addr, port, n, rank, bind = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    msg_bytes, budget = int(sys.argv[6]), float(sys.argv[7])
    t0 = time.monotonic()
    store = dist.TCPStore(addr, port, n, rank == 0, datetime.timedelta(seconds=120))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=120)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    pg = dist.ProcessGroupGloo(store, rank, n, opts)
    buf = torch.zeros(msg_bytes // 4)
    pg.allreduce([buf]).wait()
    iters, start = 0, time.perf_counter()
    while True:  # same stop rule as the precheck: everyone agrees through the last element
        buf[-1] = 1.0 if time.perf_counter() - start >= budget else 0.0
        pg.allreduce([buf]).wait()
        iters += 1
        if buf[-1].item() > 0:
            break
    per = (time.perf_counter() - start) / iters
    busbw = msg_bytes / per * 2 * (n - 1) / n
    pg.barrier().wait()
    print(json.dumps({"rank": rank, "busbw": busbw, "wall": time.monotonic() - t0}))


if __name__ == "__main__":
    main()
