"""Native threads that run no Python: CUDA, NCCL, OpenMP, BLAS, torch's pools, gRPC core."""

from __future__ import annotations

import random

from .model import (
    CYGRPC,
    LIBC,
    LIBC10,
    LIBCUDA,
    LIBGOMP,
    LIBNCCL,
    LIBOPENBLAS,
    LIBSTDCXX,
    LIBTORCH_CPU,
    LIBTORCH_CUDA,
    F,
    ThreadModel,
    c,
    unresolved,
)


def _native_thread(*inner: F) -> tuple[F, ...]:
    return (c("clone3", LIBC), c("start_thread", LIBC), *inner)


def native_only(rng: random.Random) -> list[ThreadModel]:
    out = []

    def add(comm: str, role: str, *frames: F) -> None:
        out.append(ThreadModel("", comm, role, _native_thread(*frames), py=False))

    add("cuda-EvtHandlr", "cuda", *unresolved(LIBCUDA, 4), c("poll", LIBC))
    add("cuda-EvtHandlr", "cuda", *unresolved(LIBCUDA, 4), c("poll", LIBC))
    add("cuda00002800009", "cuda", *unresolved(LIBCUDA, 5), c("__pthread_cond_wait", LIBC))
    add("cuda00001400006", "cuda", *unresolved(LIBCUDA, 3), c("__pthread_cond_timedwait", LIBC))
    for _ in range(2):  # one per communicator
        add(
            "python",
            "nccl_proxy",
            c("ncclProxyService(void*)", LIBNCCL),
            c("poll", LIBC),
        )
        add(
            "python",
            "nccl_proxy",
            c("ncclProxyProgress(void*)", LIBNCCL),
            c("progressOps", LIBNCCL),
            *unresolved(LIBNCCL, 2),
            c(rng.choice(("sched_yield", "__pthread_cond_wait")), LIBC),
        )
    add(
        "python",
        "nccl_watchdog",
        c("execute_native_thread_routine", LIBSTDCXX),
        c("c10d::ProcessGroupNCCL::ncclCommWatchdog()", LIBTORCH_CUDA),
        c("c10d::ProcessGroupNCCL::watchdogHandler()", LIBTORCH_CUDA),
        c("std::condition_variable::wait_for", LIBSTDCXX),
        c("__pthread_cond_timedwait", LIBC),
    )
    add(
        "python",
        "nccl_watchdog",
        c("execute_native_thread_routine", LIBSTDCXX),
        c("c10d::ProcessGroupNCCL::heartbeatMonitor()", LIBTORCH_CUDA),
        c("std::condition_variable::wait_until", LIBSTDCXX),
        c("__pthread_cond_timedwait", LIBC),
    )
    for _ in range(16):  # the OpenMP pool
        add(
            "python",
            "openmp",
            *unresolved(LIBGOMP, 2),
            c("do_spin", LIBGOMP),
            c("futex_wait", LIBGOMP),
        )
    for _ in range(7):  # OpenBLAS's pool (numpy's)
        add(
            "python",
            "blas",
            c("blas_thread_server", LIBOPENBLAS),
            c("sched_yield" if rng.random() < 0.3 else "__pthread_cond_wait", LIBC),
        )
    for _ in range(8):  # torch's intra-op pool
        add(
            "python",
            "intraop_pool",
            c("execute_native_thread_routine", LIBSTDCXX),
            c("c10::ThreadPool::main_loop(unsigned long)", LIBC10),
            c("std::condition_variable::wait", LIBSTDCXX),
            c("__pthread_cond_wait", LIBC),
        )
    add(
        "pt_autograd_0",
        "autograd",
        c("execute_native_thread_routine", LIBSTDCXX),
        c("torch::autograd::Engine::thread_init", LIBTORCH_CPU),
        c("torch::autograd::Engine::thread_main", LIBTORCH_CPU),
        c("torch::autograd::ReadyQueue::pop()", LIBTORCH_CPU),
        c("std::condition_variable::wait", LIBSTDCXX),
        c("__pthread_cond_wait", LIBC),
    )
    for comm in ("grpc_global_tim", "default-executo", "resolver-execut"):
        add(
            comm,
            "grpc_core",
            *unresolved(CYGRPC, 3),
            c("gpr_cv_wait", CYGRPC),
            c("__pthread_cond_timedwait", LIBC),
        )
    # a data loader's workers are processes of their own: none of their threads are here
    return out
