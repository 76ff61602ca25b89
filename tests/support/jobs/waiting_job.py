"""Two gloo ranks for tests/trainer/resilient/test_waiting.py: rank 0 blocks in an all-reduce that
rank 1 never joins; a signal must end rank 0's wait (diag.trainer.resilient.waiting), and the
aborted group must be kept until its abandoned work ends, then freed off the main thread.

    python waiting_job.py RANK PORT DIR

Rank 1 waits for DIR/interrupted (rank 0's wait ended) and DIR/release (rank 0 saw its group
kept) before it exits, which fails rank 0's abandoned work: without the interruptible wait the
two would wait on each other until gloo's 30 s timeout. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import datetime
import json
import signal
import sys
import threading
import time
from pathlib import Path


class Stop(BaseException):
    pass


def wait_file(path: Path, limit: float = 60.0) -> bool:
    deadline = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main() -> int:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    import torch
    import torch.distributed as dist

    from diag.trainer.resilient.waiting import Graveyard, interruptible_waits

    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    t = torch.ones(4)
    group = dist.new_group([0, 1])
    dist.all_reduce(t, group=group)  # the group works
    if rank == 1:
        ok = wait_file(out / "interrupted") and wait_file(out / "release")
        return 0 if ok else 1
    undo = interruptible_waits("gloo")

    def stop(*_: object) -> None:
        raise Stop

    signal.signal(signal.SIGUSR1, stop)
    main_id = threading.main_thread().ident
    threading.Timer(0.5, lambda: signal.pthread_kill(main_id, signal.SIGUSR1)).start()
    result: dict[str, object] = {}
    try:
        dist.all_reduce(t, group=group)  # rank 1 never joins
        result["interrupted"] = False
    except Stop:
        result["interrupted"] = True
    (out / "interrupted").touch()
    graveyard = Graveyard()
    graveyard.keep(list(dist.distributed_c10d._world.pg_map))
    dist.distributed_c10d._abort_process_group()
    del group
    result["kept_while_abandoned"] = graveyard.release()
    (out / "release").touch()  # rank 1 exits: the abandoned work fails, the groups may go
    deadline = time.monotonic() + 60
    freed = threading.Event()

    def release_off_main() -> None:
        while graveyard.release() and time.monotonic() < deadline:
            time.sleep(0.05)
        freed.set()

    threading.Thread(target=release_off_main).start()
    result["freed"] = freed.wait(70) and graveyard.release() == 0
    undo()
    result["restored"] = type(torch._C._distributed_c10d.Work.__dict__["wait"]).__name__
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
