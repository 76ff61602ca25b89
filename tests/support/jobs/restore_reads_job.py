"""A job that counts how often a restore from memory copies each file out of the node's slots:
a small DeepSpeed model trains two steps, saves them to memory, and loads the newest again in the
same processes, every copy out of a slot counted (diag.trainer.flash.restore._read).

    torchrun --nproc-per-node 2 tests/support/jobs/restore_reads_job.py --zero 2 --out O

Each rank writes O/reads-z<stage>-<rank>.json: the step loaded, where from, and the copies per
file.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", default="2", help="ZeRO stages, comma-separated")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch
    import torch.distributed as dist
    from dsengine import no_jit_ops, tiny_config, tiny_engine

    import diag.trainer
    from diag.trainer.flash import restore

    no_jit_ops()
    dist.init_process_group("gloo")
    copies: Counter[str] = Counter()
    read = restore._read

    def counted(path, entry, step, map_location=None):  # type: ignore[no-untyped-def]
        copies["/".join(entry.parts)] += 1
        return read(path, entry, step, map_location)

    restore._read = counted
    rank = dist.get_rank()
    for zero in (int(z) for z in args.zero.split(",")):
        torch.manual_seed(7)
        engine = tiny_engine(16, tiny_config(zero))
        save_dir = tempfile.mkdtemp(prefix="diag-test-reads-") if rank == 0 else ""
        shared = [save_dir]
        dist.broadcast_object_list(shared)
        ckpt = diag.trainer.FlashCheckpointer(
            engine, shared[0], job=f"reads-z{zero}", control=False
        )
        for step in (1, 2):
            x = torch.randn(4, 16)
            loss = (engine(x) - x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            ckpt.save(step)
        ckpt.wait()
        copies.clear()
        step = ckpt.load()
        Path(args.out, f"reads-z{zero}-{rank}.json").write_text(json.dumps({
            "step": step, "from": ckpt.stats.loaded_from, "copies": dict(copies),
        }))  # fmt: skip
        ckpt.close()
        dist.barrier()
        if rank == 0:
            import shutil

            shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
