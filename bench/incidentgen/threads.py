"""Python stacks of the kinds of thread a training process runs, and a rank's set of them."""

from __future__ import annotations

import random

from .model import (
    APP,
    CYGRPC,
    LIBC,
    LIBC10,
    LIBCUDA,
    LIBCUDART,
    LIBPY,
    LIBTORCH_CPU,
    LIBTORCH_CUDA,
    LIBTORCH_PY,
    PYBIN,
    SITE,
    STDLIB,
    F,
    RankPlan,
    ThreadModel,
    c,
    p,
    unresolved,
)


def _bootstrap() -> list[F]:
    """The outer frames of every thread Python's `threading` starts, native and Python."""
    return [
        c("clone3", LIBC),
        c("start_thread", LIBC),
        c("thread_run", LIBPY, "./Modules/_threadmodule.c:1088"),
        p("Thread._bootstrap", f"{STDLIB}/threading.py", 1002),
        p("Thread._bootstrap_inner", f"{STDLIB}/threading.py", 1045),
    ]


def _run(target: list[F]) -> list[F]:
    return [*_bootstrap(), p("Thread.run", f"{STDLIB}/threading.py", 982), *target]


def _lock_wait(timed: bool, variant: int) -> list[F]:
    """A wait on a `threading.Condition`: Python's wait, then the futex, which differs by timing."""
    inner = (
        [c("__futex_abstimed_wait_common", LIBC), c("__new_sem_wait_slow64.constprop.0", LIBC)],
        [c("syscall", LIBC)],
        [c("__futex_abstimed_wait_common", LIBC), c("do_futex_wait.constprop.0", LIBC)],
    )[variant % 3]
    return [
        p("Condition.wait", f"{STDLIB}/threading.py", 324 if timed else 320),
        c("lock_PyThread_acquire_lock", LIBPY, "./Modules/_threadmodule.c:164"),
        c("acquire_timed", LIBPY, "./Modules/_threadmodule.c:98"),
        c("PyThread_acquire_lock_timed", LIBPY, "Python/thread_pthread.h:483"),
        *inner[::-1],
    ]


def _queue_get(variant: int) -> list[F]:
    return [p("Queue.get", f"{STDLIB}/queue.py", 180), *_lock_wait(True, variant)]


def main_thread(py_frames: list[F], native_inner: list[F]) -> list[F]:
    """The main thread: interpreter start-up, the Python frames, then what they called."""
    return [
        c("_start", PYBIN),
        c("__libc_start_main_impl", LIBC),
        c("__libc_start_call_main", LIBC),
        c("main", PYBIN),
        c("Py_BytesMain", LIBPY, "Modules/main.c:734"),
        c("Py_RunMain", LIBPY, "Modules/main.c:680"),
        c("pymain_run_python", LIBPY, "Modules/main.c:595"),
        c("pymain_run_file", LIBPY, "Modules/main.c:376"),
        c("_PyRun_AnyFileObject", LIBPY, "Python/pythonrun.c:90"),
        c("_PyRun_SimpleFileObject", LIBPY, "Python/pythonrun.c:439"),
        c("pyrun_file", LIBPY, "Python/pythonrun.c:1675"),
        c("run_mod", LIBPY, "Python/pythonrun.c:1720"),
        c("run_eval_code_obj", LIBPY, "Python/pythonrun.c:1699"),
        c("PyEval_EvalCode", LIBPY, "Python/ceval.c:1154"),
        *py_frames,
        *native_inner,
    ]


def _train_outer() -> list[F]:
    eng = f"{SITE}/deepspeed/runtime/engine.py"
    return [
        p("<module>", f"{APP}/pretrain.py", 512),
        p("main", f"{APP}/pretrain.py", 488),
        p("run", f"{APP}/trainer.py", 301),
        p("train", f"{APP}/trainer.py", 244),
        p("_inner_training_loop", f"{APP}/trainer.py", 197),
        p("training_step", f"{APP}/trainer.py", 151),
        p("backward", f"{SITE}/accelerate/accelerator.py", 2473),
        p("backward", f"{SITE}/accelerate/utils/deepspeed.py", 270),
        p("_fn", f"{SITE}/torch/_dynamo/eval_frame.py", 929),
        p("_wrapped_call_impl", f"{SITE}/torch/nn/modules/module.py", 1773),
        p("_call_impl", f"{SITE}/torch/nn/modules/module.py", 1784),
        p("wrapped_fn", f"{SITE}/deepspeed/utils/nvtx.py", 20),
        p("backward", eng, 2301),
        p("wrapped_fn", f"{SITE}/deepspeed/utils/nvtx.py", 20),
        p("allreduce_gradients", eng, 2226),
    ]


def training_waiting(variant: int) -> list[F]:
    """The training thread of an ordinary rank: in a gradient all-reduce, waiting on NCCL."""
    zero = f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py"
    c10d = f"{SITE}/torch/distributed/distributed_c10d.py"
    py_frames = [
        *_train_outer(),
        p("overlapping_partition_gradients_reduce_epilogue", zero, 937),
        p("independent_gradient_partition_epilogue", zero, 1016),
        p("reduce_ipg_grads", zero, 1452),
        p("average_tensor", zero, 1181),
        p("allreduce_and_copy", zero, 1602),
        p("allreduce_bucket", zero, 1549),
        p("all_reduce", f"{SITE}/deepspeed/comm/comm.py", 668),
        p("log_wrapper", f"{SITE}/deepspeed/comm/comm.py", 117),
        p("all_reduce", f"{SITE}/deepspeed/comm/torch.py", 123),
        p("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
        p("all_reduce", c10d, 2940),
        p("wait", c10d, 3021),
    ]
    leaf = (
        [c("sched_yield", LIBC)],
        [c("__GI___clock_nanosleep", LIBC), c("__nanosleep", LIBC)][::-1],
        [c("ioctl", LIBC)],
    )[variant % 3]
    native_inner = [
        c("cfunction_call", LIBPY, "Objects/methodobject.c:542"),
        c("pybind11::cpp_function::dispatcher(_object*, _object*, _object*)", LIBTORCH_PY),
        c(
            "pybind11::cpp_function::initialize<...>::{lambda(pybind11::detail::function_call&)#3}",
            LIBTORCH_PY,
        ),
        c("pybind11::detail::argument_loader<...>::call<...>", LIBTORCH_PY),
        c("c10d::Work::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >)", LIBTORCH_CPU),
        c("c10d::ProcessGroupNCCL::WorkNCCL::wait(std::chrono::duration<long>)", LIBTORCH_CUDA),
        c("c10d::ProcessGroupNCCL::WorkNCCL::synchronizeStream()", LIBTORCH_CUDA),
        c("c10::cuda::CUDAStream::synchronize() const", LIBC10),
        c("cudaStreamSynchronize", LIBCUDART),
        *unresolved(LIBCUDART, 3),
        *unresolved(LIBCUDA, 9),
        *leaf,
    ]
    return main_thread(py_frames, native_inner)


def training_in_checkpoint() -> list[F]:
    """An odd rank: its training thread is writing a checkpoint shard."""
    ser = f"{SITE}/torch/serialization.py"
    py_frames = [
        *_train_outer()[:6],
        p("save_checkpoint", f"{SITE}/deepspeed/runtime/engine.py", 3410),
        p("_save_zero_checkpoint", f"{SITE}/deepspeed/runtime/engine.py", 3791),
        p("save", f"{SITE}/deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py", 24),
        p("save", ser, 967),
        p("_save", ser, 1257),
    ]
    native_inner = [
        c("torch::jit::PyTorchStreamWriter::writeRecord", LIBTORCH_CPU),
        c("mz_zip_writer_add_mem_ex_v2", LIBTORCH_CPU),
        c("torch::jit::PyTorchStreamWriter::writer_func_", LIBTORCH_CPU),
        c("__GI___libc_write", LIBC),
    ]
    return main_thread(py_frames, native_inner)


def training_waiting_for_data() -> list[F]:
    """An odd rank: its training thread waits for a batch from a data loader worker."""
    dl = f"{SITE}/torch/utils/data/dataloader.py"
    py_frames = [
        *_train_outer()[:5],
        p("__next__", dl, 733),
        p("_next_data", dl, 1480),
        p("_get_data", dl, 1432),
        p("_try_get_data", dl, 1275),
        *_queue_get(1),
    ]
    return main_thread(py_frames, [])


def pin_memory(busy: bool, variant: int) -> list[F]:
    pm = f"{SITE}/torch/utils/data/_utils/pin_memory.py"
    head = [p("_pin_memory_loop", pm, 59), p("do_one_step", pm, 35)]
    if busy:
        return _run(
            [
                *head,
                p("pin_memory", pm, 72),
                c("torch::autograd::THPVariable_pin_memory", LIBTORCH_PY),
                c("at::native::_pin_memory", LIBTORCH_CUDA),
                c("cudaHostAlloc", LIBCUDART),
                *unresolved(LIBCUDA, 4),
                c("ioctl", LIBC),
            ]
        )
    return _run([*head, *_queue_get(variant)])


def queue_feeder(variant: int) -> list[F]:
    return _run(
        [
            p("_feed", f"{STDLIB}/multiprocessing/queues.py", 231),
            p("wait", f"{STDLIB}/threading.py", 320),
            *_lock_wait(False, variant)[1:],
        ]
    )


def log_listener(busy: bool, variant: int) -> list[F]:
    h = f"{STDLIB}/logging/handlers.py"
    head = [p("_monitor", h, 1573)]
    if busy:
        return _run(
            [
                *head,
                p("handle", h, 1554),
                p("handle", f"{STDLIB}/logging/__init__.py", 978),
                p("emit", f"{STDLIB}/logging/__init__.py", 1239),
                p("flush", f"{STDLIB}/logging/__init__.py", 1117),
                c("_io__Buffered_flush", LIBPY),
                c("__GI___libc_write", LIBC),
            ]
        )
    return _run([*head, p("dequeue", h, 1517), *_queue_get(variant)])


def tensorboard_writer(variant: int) -> list[F]:
    w = f"{SITE}/tensorboard/summary/writer/event_file_writer.py"
    return _run([p("run", w, 244), *_queue_get(variant)])


def grpc_spin() -> list[F]:
    return _run(
        [
            p("channel_spin", f"{SITE}/grpc/_channel.py", 1925),
            c("__pyx_pw_4grpc_7_cython_6cygrpc_12SegregatedCall_5next_event", CYGRPC),
            c("grpc_completion_queue_next", CYGRPC),
            c("grpc_core::ExecCtx::Flush()", CYGRPC),
            *unresolved(CYGRPC, 2),
            c("epoll_wait", LIBC),
        ]
    )


def diag_thread(variant: int) -> list[F]:
    comp = f"{SITE}/diag/collector/completion.py"
    return _run(
        [p("_poll", comp, 58), p("wait", f"{STDLIB}/threading.py", 629), *_lock_wait(True, variant)]
    )


def diag_control(variant: int) -> list[F]:
    ctl = f"{SITE}/diag/trainer/control.py"
    return _run([p("_send", ctl, 221), *_queue_get(variant)])


def watchdog() -> list[F]:
    return _run(
        [
            p("_watchdog_loop", f"{APP}/monitor.py", 88),
            c("time_sleep", LIBPY, "./Modules/timemodule.c:2075"),
            c("__GI___clock_nanosleep", LIBC),
        ]
    )


def uploader(variant: int) -> list[F]:
    up = f"{APP}/metrics_upload.py"
    return _run([p("_thread_body", up, 142), p("_drain", up, 117), *_queue_get(variant)])


def http_server() -> list[F]:
    ss = f"{STDLIB}/socketserver.py"
    return _run(
        [
            p("serve_forever", ss, 233),
            p("select", f"{STDLIB}/selectors.py", 415),
            c("select_epoll_poll", LIBPY),
            c("epoll_wait", LIBC),
        ]
    )


def compile_reader() -> list[F]:
    sp = f"{SITE}/torch/_inductor/compile_worker/subproc_pool.py"
    return _run(
        [
            p("_read_thread", sp, 204),
            p("_recv_msg", sp, 62),
            c("_io_FileIO_readinto", LIBPY),
            c("__GI___libc_read", LIBC),
        ]
    )


def python_threads(plan: RankPlan, rng: random.Random) -> list[ThreadModel]:
    v = rng.randrange(3)
    if plan.odd == 1:
        training = training_in_checkpoint()
    elif plan.odd == 2:
        training = training_waiting_for_data()
    else:
        training = training_waiting(v)
    n = 3 + plan.counter_shift  # Python's thread counter, where this rank's helpers start

    def numbered(k: int, target: str) -> str:
        return f"Thread-{n + k} ({target})"

    out = [ThreadModel("MainThread", "pt_main_thread", "training", tuple(training))]
    out.append(
        ThreadModel(
            numbered(5, "_pin_memory_loop"),
            "python",
            "pin_memory",
            tuple(pin_memory(rng.random() < 0.5, rng.randrange(3))),
        )
    )
    out += [
        ThreadModel(
            "QueueFeederThread", "python", "queue_feeder", tuple(queue_feeder(rng.randrange(3)))
        )
        for _ in range(plan.feeders)
    ]
    out += [
        ThreadModel(
            numbered(0, "_monitor"), "python", "logger", tuple(log_listener(rng.random() < 0.02, v))
        ),
        ThreadModel(
            numbered(1, "_run"), "python", "logger", tuple(tensorboard_writer(rng.randrange(3)))
        ),
        ThreadModel(numbered(2, "channel_spin"), "python", "rpc", tuple(grpc_spin())),
        ThreadModel("diag-host-works", "python", "diag", tuple(diag_thread(rng.randrange(3)))),
        ThreadModel("diag-control-tx", "python", "diag", tuple(diag_control(rng.randrange(3)))),
        ThreadModel(numbered(3, "_watchdog_loop"), "python", "other", tuple(watchdog())),
        ThreadModel(
            numbered(4, "_thread_body"), "python", "other", tuple(uploader(rng.randrange(3)))
        ),
        ThreadModel(numbered(6, "serve_forever"), "python", "rpc", tuple(http_server())),
        ThreadModel(numbered(7, "_read_thread"), "python", "other", tuple(compile_reader())),
    ]
    return out
