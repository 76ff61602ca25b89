"""One NCCL rank whose collective is held on the device: run under torchrun by
tests/collector/test_collector_gpu.py.

    python -m torch.distributed.run --nproc-per-node 1 tests/support/jobs/cuda_hang_job.py --ctl DIR

A few steps of all_reduce on CUDA, then, at --hang-step, a kernel that spins on a flag in
host-mapped memory is queued ahead of the all_reduce on the same stream: the collective is
enqueued on the host but cannot start on the device. The rank waits for the device in a Python
loop (the GIL stays free), writes `held` into the control directory, and when `release` appears
there it dumps PyTorch's NCCL flight recorder (`fr.json`, or `fr.error`) and sets the flag: the
kernel ends, the collective runs, and the job finishes its steps and writes `done`.

Without CuPy (it compiles the kernel with NVRTC) the hold is `torch.cuda._sleep` instead, which
ends by itself after --sleep-s seconds rather than on the flag (`held` says which).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from pathlib import Path

SPIN = r"""
extern "C" __global__ void diag_spin(volatile int* flag) {
    while (*flag == 0) {
        __nanosleep(1000);
    }
}
"""


class Hold:
    """A kernel on the current stream that runs until `release()`."""

    def __init__(self, torch, sleep_s: float) -> None:
        self.kind = "flag"
        try:
            import cupy
            import numpy

            self._cupy = cupy
            # cudaHostAllocMapped | cudaHostAllocPortable: with unified addressing the host
            # pointer is valid on the device too.
            self._ptr = cupy.cuda.runtime.hostAlloc(4, 3)
            self._flag = ctypes.c_int32.from_address(self._ptr)
            self._flag.value = 0
            kernel = cupy.RawKernel(SPIN, "diag_spin")
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            with stream:
                kernel((1,), (1,), (numpy.uint64(self._ptr),))
        except Exception as e:  # no CuPy, or NVRTC missing: a timed spin instead
            self.kind = f"sleep ({type(e).__name__}: {e})"
            self._ptr = 0
            props = torch.cuda.get_device_properties(0)
            rate = getattr(props, "clock_rate", 0) * 1000 or 2_000_000_000
            torch.cuda._sleep(int(sleep_s * rate))

    def release(self) -> None:
        if self._ptr:
            self._flag.value = 1

    def free(self) -> None:
        if self._ptr:
            self._cupy.cuda.runtime.freeHost(self._ptr)
            self._ptr = 0


def flight_recorder(torch) -> str:
    from torch._C import _distributed_c10d as c10d

    return c10d._dump_nccl_trace_json(includeCollectives=True, onlyActive=False)


def wait_for_device(torch, done, hold: Hold | None, ctl: Path) -> None:
    released = False
    while not done.query():
        if hold is not None and not released and (ctl / "release").exists():
            try:
                dump = flight_recorder(torch)  # str or bytes, by torch version (2.11: bytes)
                (ctl / "fr.json").write_bytes(dump if isinstance(dump, bytes) else dump.encode())
            except Exception as e:
                (ctl / "fr.error").write_text(f"{type(e).__name__}: {e}")
            hold.release()
            released = True
        time.sleep(0.002)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ctl", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hang-step", type=int, default=8)
    p.add_argument("--sleep-s", type=float, default=20.0)
    a = p.parse_args()
    import torch
    import torch.distributed as dist

    import diag.trainer

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    diag.trainer.attach()
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    x = torch.ones(1 << 20, device="cuda")
    for step in range(1, a.steps + 1):
        hold = Hold(torch, a.sleep_s) if step == a.hang_step else None
        dist.all_reduce(x)
        x /= world
        done = torch.cuda.Event()
        done.record()
        if hold is not None:
            (a.ctl / "held").write_text(json.dumps({"step": step, "hold": hold.kind}))
        wait_for_device(torch, done, hold, a.ctl)
        if hold is not None:
            hold.free()
        diag.trainer.step()
        time.sleep(0.05)
    ok = bool(torch.all(x == 1).item())
    (a.ctl / "done").write_text(json.dumps({"ok": ok}))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
