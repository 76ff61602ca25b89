"""The measuring adapter: matmul throughput, intra-node copies and the inter-node pair allreduce.

torch is imported inside each function, never at module import. On CPU the pair test runs gloo;
on GPU it runs NCCL timed with CUDA events. Every blocking step has a deadline.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from diag.agent.precheck.measurements import ComputeResult, CopyResult, PairSide

log = logging.getLogger(__name__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else type(e).__name__
    # gloo prefixes its source location: keep the message that follows it.
    if msg.startswith("[") and "] " in msg:
        msg = msg.split("] ", 1)[1]
    return msg[:200]


def detect_accelerator(flag: str) -> tuple[str, int]:
    """("cuda", device count) or ("cpu", 1) for `--device auto|cpu|cuda`."""
    import torch

    if flag == "cpu":
        return "cpu", 1
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    if flag == "cuda":
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    return "cpu", 1


def matmul_throughput(
    device: str, size: int, seconds: float, threads: int = 1, windows: int = 5
) -> ComputeResult:
    """Best FLOP/s over a few equal windows: the best window is robust to brief contention.

    On CPU the matmul runs on `threads` threads: multi-threaded BLAS collapses (threads spin
    waiting for each other) when the cores are shared, which would make the number noise."""
    import torch

    cuda = device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(threads)
    dtype = torch.float32
    if cuda:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    label = str(dtype).removeprefix("torch.")
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        flop = 2.0 * size**3
        window = max(seconds / windows, 0.01)
        best = 0.0
        if cuda:
            best = _cuda_matmul(torch, device, a, b, flop, window, windows)
        else:
            torch.matmul(a, b)
            for _ in range(windows):
                t0, n = time.perf_counter(), 0
                while time.perf_counter() - t0 < window:
                    torch.matmul(a, b)
                    n += 1
                best = max(best, flop * n / (time.perf_counter() - t0))
        return ComputeResult(
            device=device,
            flops=best,
            matmul_size=size,
            dtype=label,
            threads=0 if cuda else threads,
        )
    except Exception as e:  # a broken device must become a finding, not a crash
        return ComputeResult(device=device, matmul_size=size, dtype=label, error=_first_line(e))


def _cuda_matmul(
    torch: Any, device: str, a: Any, b: Any, flop: float, window: float, windows: int
) -> float:
    """Events are recorded on the current stream of the current device: make it `device`."""
    best = 0.0
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)  # warm-up, and a first timing to size the windows
        end.record()
        end.synchronize()
        per = max(start.elapsed_time(end) / 1e3, 1e-6)
        iters = max(1, int(window / per))
        for _ in range(windows):
            start.record()
            for _ in range(iters):
                torch.matmul(a, b)
            end.record()
            end.synchronize()
            best = max(best, flop * iters / (start.elapsed_time(end) / 1e3))
    return best


def copy_bandwidth(src: int, dst: int, nbytes: int, iters: int = 5) -> CopyResult:
    """Device-to-device copy bandwidth between two local GPUs (peer copy where supported)."""
    import torch

    try:
        a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
        b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
        b.copy_(a)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        for _ in range(iters):
            b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        return CopyResult(src, dst, nbytes * iters / (time.perf_counter() - t0))
    except Exception as e:
        return CopyResult(src, dst, error=_first_line(e))


@dataclass(frozen=True)
class PairPlan:
    """One node's part in one pair test."""

    round: int
    node: int
    peer: int
    rank_in_pair: int  # 0 for the lower node rank
    msg_bytes: int
    pair_seconds: float
    warmup_iters: int
    max_iters: int
    connect_timeout_s: float
    collective_timeout_s: float


def pair_limit_s(plan: PairPlan) -> float:
    """The longest one pair test may take when every step runs into its own timeout."""
    from diag.agent.precheck.liveness import pair_limit_s as limit

    return limit(
        plan.connect_timeout_s, plan.collective_timeout_s, plan.pair_seconds, plan.warmup_iters
    )


def bounded_pair_allreduce(
    store: Any, plan: PairPlan, accelerator: str, bind_addr: str | None, net_device: int = 0
) -> tuple[PairSide, bool]:
    """`pair_allreduce` that returns within `pair_limit_s`; True when it had to be abandoned.

    gloo retries connecting to a peer that died after publishing its address for ~20-30 s,
    whatever timeout the group was given; the test then counts as failed and its thread is
    left to finish on its own (the caller must not wait for it at exit)."""
    import threading

    box: list[PairSide] = []
    worker = threading.Thread(
        target=lambda: box.append(pair_allreduce(store, plan, accelerator, bind_addr, net_device)),
        name=f"pair-{plan.round}-{plan.peer}",
        daemon=True,
    )
    worker.start()
    limit = pair_limit_s(plan)
    worker.join(limit)
    if box:
        return box[0], False
    side = PairSide(
        round=plan.round,
        node=plan.node,
        peer=plan.peer,
        msg_bytes=plan.msg_bytes,
        error=f"no progress with node {plan.peer} within {limit:g} s",
    )
    return side, True


def busbw(msg_bytes: int, seconds_per_iter: float, world: int = 2) -> float:
    """nccl-tests convention for allreduce: algbw = S/t, busbw = algbw x 2(n-1)/n."""
    return msg_bytes / seconds_per_iter * 2 * (world - 1) / world


def pair_allreduce(
    store: Any, plan: PairPlan, accelerator: str, bind_addr: str | None, net_device: int = 0
) -> PairSide:
    """Allreduce `msg_bytes` back and forth with the peer until the time budget is used.

    Both sides must run the same number of iterations: each side puts "I want to stop" into
    the last element of the buffer, and after the sum both see the same flag."""
    import torch
    import torch.distributed as dist

    side: dict[str, Any] = dict(
        round=plan.round, node=plan.node, peer=plan.peer, msg_bytes=plan.msg_bytes
    )
    prefix = dist.PrefixStore(
        f"pg/{plan.round}/{min(plan.node, plan.peer)}-{max(plan.node, plan.peer)}/", store
    )
    cuda = accelerator == "cuda"
    t_connect = time.monotonic()
    try:
        pg = _nccl_group(prefix, plan, net_device) if cuda else _gloo_group(prefix, plan, bind_addr)
    except Exception as e:
        return PairSide(**side, error=f"could not connect to node {plan.peer}: {_first_line(e)}")
    log.debug("pair %s connected in %.3f s", side, time.monotonic() - t_connect)
    device = f"cuda:{net_device}" if cuda else "cpu"
    buf = torch.zeros(max(plan.msg_bytes // 4, 2), dtype=torch.float32, device=device)
    nbytes = buf.numel() * 4
    opts = dist.AllreduceOptions()
    opts.timeout = timedelta(seconds=plan.collective_timeout_s)
    iters = 0
    try:
        for _ in range(plan.warmup_iters):
            _allreduce(pg, buf, opts, plan, cuda)
        start = time.perf_counter()
        events = _cuda_events(cuda)
        while True:
            elapsed = time.perf_counter() - start
            want_stop = elapsed >= plan.pair_seconds or iters + 1 >= plan.max_iters
            buf[-1] = 1.0 if want_stop else 0.0
            _allreduce(pg, buf, opts, plan, cuda)
            iters += 1
            if float(buf[-1].item()) > 0:
                break
        seconds = _elapsed(events, start)
    except Exception as e:
        _drop(pg, cuda, failed=True)
        return PairSide(**side, iters=iters, error=_first_line(e))
    _drop(pg, cuda, failed=False)
    return PairSide(**side, busbw=busbw(nbytes, seconds / iters), iters=iters, seconds=seconds)


def _gloo_group(prefix: Any, plan: PairPlan, bind_addr: str | None) -> Any:
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    # The connect step waits on the store for the peer's address with this timeout.
    opts._timeout = timedelta(seconds=plan.connect_timeout_s)
    if bind_addr:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_addr)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(prefix, plan.rank_in_pair, 2, opts)


def _nccl_group(prefix: Any, plan: PairPlan, net_device: int) -> Any:
    import torch
    import torch.distributed as dist

    # We enforce our own deadlines and abort the communicator on expiry; NCCL's watchdog must
    # not tear the process down first.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    torch.cuda.set_device(net_device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=plan.connect_timeout_s + plan.collective_timeout_s + 60)
    return dist.ProcessGroupNCCL(prefix, plan.rank_in_pair, 2, opts)


def _allreduce(pg: Any, buf: Any, opts: Any, plan: PairPlan, cuda: bool) -> None:
    work = pg.allreduce([buf], opts)
    if not cuda:
        work.wait()  # gloo honours opts.timeout and raises on expiry or a reset connection
        return
    deadline = time.monotonic() + plan.connect_timeout_s + plan.collective_timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"allreduce with node {plan.peer} did not finish within "
                f"{plan.collective_timeout_s:g} s"
            )
        time.sleep(0.0005)
    work.wait()


def _cuda_events(cuda: bool) -> Any:
    if not cuda:
        return None
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


def _elapsed(events: Any, start: float) -> float:
    if events is None:
        return time.perf_counter() - start
    begin, end = events
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _drop(pg: Any, cuda: bool, failed: bool) -> None:
    """Release the pair's group; an NCCL communicator that may be stuck is aborted."""
    try:
        if cuda and failed:
            pg.abort()
        else:
            pg.shutdown()
    except Exception as e:
        log.debug("releasing the pair group: %s", e)
