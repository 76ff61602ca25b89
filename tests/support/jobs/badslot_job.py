"""A one-rank DeepSpeed job (gloo, CPU) whose flash snapshots cannot be loaded: their client state
unpickles into an error or a memory bomb, as a corrupted or planted slot would. Each relaunch is
a new FlashCheckpointer on the same engine, in the same process (what a restart does, without
paying for a second DeepSpeed start).

    python tests/support/jobs/badslot_job.py --run-dir R --save-dir S --out O.json [--phases ...]

- valueerror: step 1 to memory and to storage, step 2 to memory holding ZeroStageEnum(99) (a
  ValueError when unpickled); a relaunch loads, then another one.
- bomb: steps 2 and 3 to memory, each holding 3 GiB of float64 made from a numpy array never
  written (a 1 KB pickle); a relaunch loads, its resident set measured.
Each load's step, source and memory growth go to --out as JSON, with the generation of every
slot afterwards (odd: torn).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
from pathlib import Path
from typing import Any


class Fails:
    """Pickles as a call that raises when unpickled: a ZeRO stage that does not exist."""

    def __reduce__(self) -> tuple:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        return (ZeroStageEnum, (99,))


class Bomb:
    """Pickles as a tensor converted from a numpy array of 384 M bytes never written: a few
    bytes of pickle that would allocate 3 GiB of float64."""

    def __reduce__(self) -> tuple:
        import torch

        return (
            torch._utils._rebuild_device_tensor_from_numpy,
            (_Empty(), torch.float64, "cpu", False),
        )


class _Empty:
    def __reduce__(self) -> tuple:
        import numpy

        return (numpy._core.multiarray._reconstruct, (numpy.ndarray, (3 << 30 >> 3,), b"b"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--save-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--phases", default="valueerror,bomb")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29500")
    import psutil
    import torch
    import torch.distributed as dist
    from dsengine import no_jit_ops, tiny_config, tiny_engine

    from diag.formats.slotfile import SlotFile
    from diag.formats.snapshot import find_slots
    from diag.trainer import FlashCheckpointer

    no_jit_ops()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    engine = tiny_engine(16, tiny_config(2, micro_batch=2))

    def train() -> None:
        x = torch.randn(2, 16)
        engine.backward((engine(x) - x).pow(2).mean())
        engine.step()

    def checkpointer() -> Any:
        return FlashCheckpointer(engine, args.save_dir, run_dir=args.run_dir, job="bad",
                                 control=False)  # fmt: skip

    def relaunch(phase: str) -> dict:
        ckpt = checkpointer()
        rss, peak = psutil.Process().memory_info().rss, _peak()
        step = ckpt.load()
        got = {
            "phase": phase, "step": step, "from": ckpt.stats.loaded_from,
            "client_state": repr(ckpt.client_state)[:200],
            "rss_grew": psutil.Process().memory_info().rss - rss, "peak_grew": _peak() - peak,
        }  # fmt: skip
        ckpt.close(remove=False)
        got["gens"] = {p.name: _gen(SlotFile, p) for p in find_slots(args.run_dir, "bad")}
        return got

    results = []
    ckpt = checkpointer()
    train()
    ckpt.save(1, {"data_step": 1})
    ckpt.wait()
    engine.save_checkpoint(str(args.save_dir), tag="global_step1", client_state={"data_step": 1})
    for phase in args.phases.split(","):
        if phase == "valueerror":
            train()
            ckpt.save(2, {"data_step": 2, "stage": Fails()})
            ckpt.close(remove=False)
            results.append(relaunch(phase))
            results.append(relaunch(phase + "-again"))
        elif phase == "bomb":
            for step in (2, 3):
                train()
                ckpt.save(step, {"data_step": step, "bomb": Bomb()})
            ckpt.close(remove=False)
            results.append(relaunch(phase))
        ckpt = checkpointer()
    ckpt.close(remove=True)
    args.out.write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gen(slot_file: Any, path: Path) -> list[int]:
    slot = slot_file.open(path)
    try:
        h = slot.header()
        return [h.step, h.gen]
    finally:
        slot.close()


if __name__ == "__main__":
    raise SystemExit(main())
