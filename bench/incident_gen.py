"""Production-shaped stack dumps of a hung training job, for `diag merge` tests and benches.

What a real incident of a large GPU job looks like, rank by rank:
- ~15 Python threads: the training thread (the main thread, waiting in a collective), the data
  loader's pin-memory thread and one queue feeder per worker, a logging queue listener, a
  TensorBoard writer, the gRPC client's channel-spin thread, diag's own threads, a user's
  watchdog, a metrics uploader, a debug HTTP server, a compile-worker reader. Threads named by
  Python's counter (`Thread-7 (_pin_memory_loop)`) carry other numbers on some ranks (they
  started one more helper earlier), some ranks have one queue feeder more or less, and helper
  threads sit in different places with timing alone (waiting on a queue, or pinning a batch).
- ~60 native threads (gdb's view): the Python threads with the interpreter's frames, plus CUDA,
  NCCL proxy and watchdog, OpenMP, intra-op pool, autograd and gRPC core threads. The training
  thread is ~200 frames deep; many frames are unresolved (`??` in gdb, a hex address in py-spy).
  The innermost native frame of a waiting thread varies with timing (spinning, yielding, futex).
- What goes wrong: odd ranks whose training thread is stuck elsewhere (in a checkpoint write, or
  waiting for data), ranks without a dump (scattered, and whole nodes), corrupt files, dumps
  that timed out.

Three formats, as `diag merge` reads them: `diag` (`{rank}-{world}.stack.json`: the Python
threads with native frames interleaved, as `py-spy dump --native` gives them, plus every
thread's gdb stack in `native_threads`), `xpu` (xpu_timer's `.stacktrace` protobuf: py-spy
threads without native frames, and pstack threads), `pyspy` (raw `py-spy dump --json --native`
output, which lists only threads that run Python), or `mixed` (rank by rank in turn).

Next to the dumps, `truth.json` says what was injected (odd, missing, corrupt and timed-out ranks,
missing nodes); it is no dump file, so `diag merge` leaves it alone.

    .venv/bin/python bench/incident_gen.py OUT --ranks 1344 [--format xpu] [--scenario odd]

A scenario is `odd` (answering ranks disagree: the odd ranks lead) or `agree` (every answering
rank waits in the same place: the ranks that did not answer lead).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from diag.proto import hosting_service_pb2 as xpu_pb2

FORMATS = ("diag", "xpu", "pyspy", "mixed")
SCENARIOS = ("odd", "agree")
TRUTH_FILE = "truth.json"

STDLIB = "/usr/local/lib/python3.11"
SITE = f"{STDLIB}/site-packages"
APP = "/workspace/train"
LIBPY = "/usr/local/lib/libpython3.11.so.1.0"
PYBIN = "/usr/local/bin/python3.11"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
LIBCUDART = f"{SITE}/nvidia/cuda_runtime/lib/libcudart.so.12"
LIBNCCL = f"{SITE}/nvidia/nccl/lib/libnccl.so.2"
LIBTORCH_CUDA = f"{SITE}/torch/lib/libtorch_cuda.so"
LIBTORCH_CPU = f"{SITE}/torch/lib/libtorch_cpu.so"
LIBTORCH_PY = f"{SITE}/torch/lib/libtorch_python.so"
LIBC10 = f"{SITE}/torch/lib/libc10.so"
LIBGOMP = f"{SITE}/torch/lib/libgomp-a34b3233.so.1"
LIBOPENBLAS = f"{SITE}/numpy.libs/libopenblas64_p-r0-0cf96a72.3.23.dev.so"
CYGRPC = f"{SITE}/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so"
CEVAL = "/usr/src/python3.11/Python/ceval.c"


# -- the model: one thread is a list of frames, root first ------------------------------------


@dataclass(frozen=True)
class F:
    """A frame of the model. `lib` set: native (`src` is its "file.c:line" when gdb knows it);
    else Python (`file`, `line`). `func` "??" is an unresolved native frame."""

    func: str
    file: str = ""
    line: int = 0
    lib: str = ""
    src: str = ""

    @property
    def native(self) -> bool:
        return bool(self.lib)


def p(func: str, file: str, line: int) -> F:
    return F(func, file, line)


def c(func: str, lib: str, src: str = "") -> F:
    return F(func, lib=lib, src=src)


def unresolved(lib: str, n: int) -> list[F]:
    return [c("??", lib) for _ in range(n)]


@dataclass(frozen=True)
class ThreadModel:
    name: str  # Python's thread name ("" for a thread that runs no Python)
    comm: str  # the name gdb shows (the kernel's comm: "python", "pt_autograd_0", ...)
    role: str  # what it is, for the truth file: training, pin_memory, queue_feeder, ...
    frames: tuple[F, ...]
    py: bool = True  # runs Python: listed by py-spy too


@dataclass(frozen=True)
class Truth:
    world_size: int
    local_world_size: int
    scenario: str
    format: str
    seed: int
    odd_ranks: tuple[int, ...]
    missing_ranks: tuple[int, ...]  # no dump file at all
    missing_nodes: tuple[int, ...]  # node index: ranks node*local .. node*local+local-1
    corrupt_ranks: tuple[int, ...]  # a file that does not decode
    timed_out_ranks: tuple[int, ...]  # a file saying the dump timed out, without stacks
    extra_feeder_ranks: tuple[int, ...]  # one queue feeder more than the others
    fewer_feeder_ranks: tuple[int, ...]
    renumbered_ranks: int  # ranks whose helper threads carry other counter numbers
    python_threads: int  # per ordinary rank
    native_threads: int
    deepest_native: int
    formats: dict[str, int] = field(default_factory=dict)  # files per format

    @property
    def unanswered(self) -> tuple[int, ...]:
        """Ranks without a usable dump: missing, corrupt or timed out."""
        return tuple(sorted({*self.missing_ranks, *self.corrupt_ranks, *self.timed_out_ranks}))

    def node_ranks(self, node: int) -> range:
        return range(node * self.local_world_size, (node + 1) * self.local_world_size)

    @classmethod
    def load(cls, directory: Path) -> Truth:
        raw = json.loads((Path(directory) / TRUTH_FILE).read_text())
        for k, v in raw.items():
            if isinstance(v, list):
                raw[k] = tuple(v)
        return cls(**raw)


# -- Python stacks of the kinds of thread a training process runs --------------------------------


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


# -- threads that run no Python ------------------------------------------------------------------


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


# -- a rank --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlan:
    rank: int
    odd: int  # 0: ordinary; 1: checkpoint write; 2: waiting for data
    counter_shift: int  # added to every `Thread-N` number
    feeders: int
    seed: int


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


# -- projections of the model into the three formats ---------------------------------------------

# gdb shows these interpreter frames for every Python frame (3.11: one C eval frame runs several
# Python frames; we keep it simple and regular).
_EVAL = (
    c("_PyEval_EvalFrameDefault", LIBPY, f"{CEVAL}:5333"),
    c("_PyEval_EvalFrame", LIBPY, "./Include/internal/pycore_ceval.h:73"),
    c("_PyEval_Vector", LIBPY, f"{CEVAL}:6434"),
    c("_PyFunction_Vectorcall", LIBPY, "Objects/call.c:393"),
    c("_PyObject_VectorcallTstate", LIBPY, "./Include/internal/pycore_call.h:92"),
    c("PyObject_Vectorcall", LIBPY, "Objects/call.c:299"),
)


def gdb_frames(frames: tuple[F, ...]) -> list[F]:
    """gdb's view of a thread, root first: each Python frame becomes the interpreter's frames."""
    out: list[F] = []
    for f in frames:
        if f.native:
            out.append(f)
        else:
            out.extend(_EVAL)
    return out


class Addresses:
    """Load addresses of a process's libraries (ASLR: they differ per process), for the hex
    addresses py-spy prints for unresolved frames and gdb prints on every line."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.base: dict[str, int] = {}

    def of(self, lib: str, index: int) -> int:
        b = self.base.get(lib)
        if b is None:
            b = self.base[lib] = 0x7F0000000000 + self.rng.randrange(1 << 28) * 0x1000
        return b + 0x1000 + index * 0x1F3


def pyspy_frames(frames: tuple[F, ...], addr: Addresses) -> list[dict]:
    """`py-spy dump --json --native` frames, innermost first: Python frames and native ones
    interleaved, unresolved ones as hex addresses."""
    out = []
    for i, f in enumerate(reversed(frames)):
        if f.native:
            name = f.func if f.func != "??" else hex(addr.of(f.lib, i))
            short = f.lib.rsplit("/", 1)[-1]
            out.append(
                {
                    "name": name,
                    "filename": f.lib,
                    "module": f.lib,
                    "short_filename": short,
                    "line": 0,
                    "locals": None,
                }
            )
        else:
            out.append(
                {
                    "name": f.func,
                    "filename": f.file,
                    "module": None,
                    "short_filename": f.file.rsplit("/", 1)[-1],
                    "line": f.line,
                    "locals": None,
                }
            )
    return out


def diag_frames(frames: list[F] | tuple[F, ...], native: bool) -> list[dict]:
    """`diag.stack/1` frames, root first."""
    out = []
    for f in frames:
        if f.native:
            if not native:
                continue
            out.append({"func": f.func, "file": f.lib, "line": 0, "native": True, "module": f.lib})
        else:
            out.append(
                {"func": f.func, "file": f.file, "line": f.line, "native": False, "module": ""}
            )
    return out


def _gdb_line(n: int, f: F, address: int) -> str:
    where = f" at {f.src}" if f.src else (f" from {f.lib}" if f.lib else "")
    return f"#{n:<3}0x{address:016x} in {f.func} (){where}"


@dataclass
class RankThreads:
    """One rank's threads with its ids: (model, python tid, os tid)."""

    pid: int
    threads: list[tuple[ThreadModel, int, int]]


def rank_threads(plan: RankPlan, rng: random.Random) -> RankThreads:
    pid = 1000 + rng.randrange(60000)
    models = python_threads(plan, rng) + native_only(rng)
    out = []
    for i, m in enumerate(models):
        lwp = pid if i == 0 else pid + 7 + i * 3 + rng.randrange(3)
        tid = 0x7F0000000000 + rng.randrange(1 << 30) * 0x1000 if m.py else 0
        out.append((m, tid, lwp))
    return RankThreads(pid, out)


def diag_dump(rt: RankThreads, rank: int, world: int, local: int, state: str) -> dict:
    threads, native_threads = [], []
    for m, tid, lwp in rt.threads:
        if m.py:
            threads.append(
                {
                    "tid": tid,
                    "os_tid": lwp,
                    "name": m.name,
                    "frames": diag_frames(m.frames, True),
                    "active": False,
                    "owns_gil": False,
                }
            )
        native_threads.append(
            {
                "tid": lwp,
                "os_tid": lwp,
                "name": m.comm,
                "frames": diag_frames(gdb_frames(m.frames), True),
                "active": False,
                "owns_gil": False,
            }
        )
    return {
        "rank": rank,
        "world_size": world,
        "pid": rt.pid,
        "node": f"node-{rank // local:04d}",
        "local_rank": rank % local,
        "process_state": state,
        "native": True,
        "captured_at": "2026-11-23T04:12:09Z",
        "capture_seconds": 0.74,
        "threads": threads,
        "error": "",
        "format": "diag.stack/1",
        "native_threads": native_threads,
    }


def pyspy_dump(rt: RankThreads, addr: Addresses) -> list[dict]:
    return [
        {
            "pid": rt.pid,
            "thread_id": tid,
            "thread_name": m.name,
            "os_thread_id": lwp,
            "active": False,
            "owns_gil": False,
            "frames": pyspy_frames(m.frames, addr),
        }
        for m, tid, lwp in rt.threads
        if m.py
    ]


def xpu_dump(rt: RankThreads, rank: int, state: str, addr: Addresses) -> bytes:
    st = xpu_pb2.Stacktrace(pid=rt.pid, rank=rank, process_state=state)
    # gdb lists threads newest first
    for m, _tid, lwp in reversed(rt.threads):
        t = st.stacktrace.add(pid=lwp, thread_name=m.comm)
        for n, f in enumerate(reversed(gdb_frames(m.frames))):
            file_name = f.src or f.lib or "??"
            t.frames.add(
                func_name=f.func,
                file_name=file_name,
                origin=_gdb_line(n, f, addr.of(f.lib or "-", n)),
            )
    for m, tid, lwp in rt.threads:
        if not m.py:
            continue
        t = st.py_stacktrace.add(pid=rt.pid, thread_id=tid, thread_name=m.name, os_thread_id=lwp)
        for f in reversed(m.frames):
            if not f.native:  # xpu_timer runs py-spy without --native
                t.frames.add(func_name=f.func, file_name=f"{f.file}:{f.line}", module="unknown")
    return st.SerializeToString()


# -- the incident --------------------------------------------------------------------------------


def _pick(rng: random.Random, pool: list[int], n: int) -> list[int]:
    out = sorted(rng.sample(pool, min(n, len(pool))))
    for r in out:
        pool.remove(r)
    return out


def plan_incident(
    world: int,
    *,
    local: int = 8,
    scenario: str = "odd",
    fmt: str = "diag",
    seed: int = 1,
    odd: int = 1,
    missing_nodes: int = 1,
    missing_ranks: int = 2,
    corrupt: int = 2,
    timed_out: int = 1,
) -> Truth:
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    if world % local:
        raise ValueError(f"world size {world} is no multiple of the local world size {local}")
    rng = random.Random(seed)
    nodes = world // local
    dead_nodes = sorted(rng.sample(range(1, nodes), min(missing_nodes, max(nodes - 1, 0))))
    pool = [r for r in range(world) if r // local not in dead_nodes]
    odd_ranks = _pick(rng, pool, odd) if scenario == "odd" else []
    gone = _pick(rng, pool, missing_ranks)
    bad = _pick(rng, pool, corrupt)
    late = _pick(rng, pool, timed_out)
    more = _pick(rng, pool, max(1, world // 1000))
    fewer = _pick(rng, pool, max(1, world // 2000))
    missing = sorted({*gone, *(r for n in dead_nodes for r in range(n * local, (n + 1) * local))})
    return Truth(
        world_size=world,
        local_world_size=local,
        scenario=scenario,
        format=fmt,
        seed=seed,
        odd_ranks=tuple(odd_ranks),
        missing_ranks=tuple(missing),
        missing_nodes=tuple(dead_nodes),
        corrupt_ranks=tuple(bad),
        timed_out_ranks=tuple(late),
        extra_feeder_ranks=tuple(more),
        fewer_feeder_ranks=tuple(fewer),
        renumbered_ranks=0,
        python_threads=0,
        native_threads=0,
        deepest_native=0,
    )


FEEDERS = 4


def rank_plan(truth: Truth, rank: int) -> RankPlan:
    rng = random.Random(truth.seed * 1_000_003 + rank)
    odd = 0
    if rank in truth.odd_ranks:
        odd = 1 + truth.odd_ranks.index(rank) % 2
    # Most ranks start their helpers in one order; some started one or five threads more first
    # (an extra loader, a retry), which shifts every `Thread-N` number: Thread-9 vs Thread-10.
    x = rng.random()
    shift = 0 if x < 0.7 else 1 if x < 0.9 else 5
    feeders = FEEDERS + (rank in truth.extra_feeder_ranks) - (rank in truth.fewer_feeder_ranks)
    return RankPlan(rank, odd, shift, feeders, truth.seed * 7919 + rank)


def file_format(truth: Truth, rank: int) -> str:
    if truth.format != "mixed":
        return truth.format
    return ("diag", "xpu", "pyspy")[rank % 3]


SUFFIX = {"diag": ".stack.json", "xpu": ".stacktrace", "pyspy": ".pyspy.json"}


def rank_file(truth: Truth, rank: int) -> tuple[str, bytes] | None:
    """The file name and content of one rank's dump, None when it has none."""
    if rank in truth.missing_ranks:
        return None
    fmt = file_format(truth, rank)
    name = f"{rank:05d}-{truth.world_size:05d}{SUFFIX[fmt]}"
    plan = rank_plan(truth, rank)
    rng = random.Random(plan.seed)
    state = "S (sleeping)"
    if rank in truth.timed_out_ranks:
        return name, _timed_out(truth, rank, fmt)
    rt = rank_threads(plan, rng)
    addr = Addresses(rng)
    if fmt == "diag":
        data = orjson.dumps(diag_dump(rt, rank, truth.world_size, truth.local_world_size, state))
    elif fmt == "pyspy":
        data = orjson.dumps(pyspy_dump(rt, addr))
    else:
        data = xpu_dump(rt, rank, state, addr)
    if rank in truth.corrupt_ranks:
        data = _corrupt(data, fmt)
    return name, data


def _timed_out(truth: Truth, rank: int, fmt: str) -> bytes:
    why = "py-spy dump timed out after 30 s"
    if fmt == "diag":
        return orjson.dumps(
            {
                "rank": rank,
                "world_size": truth.world_size,
                "pid": 4242,
                "node": f"node-{rank // truth.local_world_size:04d}",
                "local_rank": rank % truth.local_world_size,
                "process_state": "S (sleeping)",
                "native": False,
                "threads": [],
                "error": why,
                "format": "diag.stack/1",
            }
        )
    if fmt == "pyspy":
        return b"[]"  # what a py-spy that gave up in the middle leaves: no thread
    return xpu_pb2.Stacktrace(
        pid=4242,
        rank=rank,
        process_state="S (sleeping)",
        pyspy_stderr=f"Error: {why}",
        pstack_stderr="gdb: timeout after 30 s, killed",
    ).SerializeToString()


def _corrupt(data: bytes, fmt: str) -> bytes:
    if fmt == "xpu":
        # cut inside a length-delimited field: the protobuf runtime refuses it
        return data[: len(data) // 2]
    return data[: len(data) // 3]


def _counts(truth: Truth) -> tuple[int, int, int]:
    plan = RankPlan(0, 0, 0, FEEDERS, 0)
    rt = rank_threads(plan, random.Random(0))
    py = sum(1 for m, _, _ in rt.threads if m.py)
    deepest = max(len(gdb_frames(m.frames)) for m, _, _ in rt.threads)
    return py, len(rt.threads), deepest


def _shifted(truth: Truth) -> int:
    return sum(1 for r in range(truth.world_size) if rank_plan(truth, r).counter_shift)


def write_incident(directory: Path, truth: Truth, workers: int = 1) -> Truth:
    """Writes every rank's dump and `truth.json` into `directory`; returns the truth completed
    with what it counted."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = list(range(truth.world_size))
    if workers > 1 and len(ranks) > 256:
        import multiprocessing

        chunks = [ranks[i::workers] for i in range(workers)]
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(workers) as pool:
            parts = pool.starmap(_write_ranks, [(directory, truth, ch) for ch in chunks])
    else:
        parts = [_write_ranks(directory, truth, ranks)]
    formats: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            formats[k] = formats.get(k, 0) + v
    py, native, deepest = _counts(truth)
    done = Truth(
        **{
            **asdict(truth),
            "renumbered_ranks": _shifted(truth),
            "python_threads": py,
            "native_threads": native,
            "deepest_native": deepest,
            "formats": dict(sorted(formats.items())),
        }
    )
    (directory / TRUTH_FILE).write_text(json.dumps(asdict(done), indent=1) + "\n")
    return done


def _write_ranks(directory: Path, truth: Truth, ranks: list[int]) -> dict[str, int]:
    formats: dict[str, int] = {}
    for r in ranks:
        found = rank_file(truth, r)
        if found is None:
            continue
        name, data = found
        with open(os.path.join(directory, name), "wb") as fh:
            fh.write(data)
        fmt = file_format(truth, r)
        formats[fmt] = formats.get(fmt, 0) + 1
    return formats


def iter_sizes(directory: Path) -> Iterator[int]:
    for e in os.scandir(directory):
        if e.name != TRUTH_FILE:
            yield e.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write the dumps into")
    ap.add_argument("--ranks", type=int, default=1344)
    ap.add_argument("--local", type=int, default=8, help="ranks per node")
    ap.add_argument("--format", choices=FORMATS, default="diag")
    ap.add_argument("--scenario", choices=SCENARIOS, default="odd")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--odd", type=int, default=1, help="odd ranks (scenario odd)")
    ap.add_argument("--missing-nodes", type=int, default=1)
    ap.add_argument("--missing-ranks", type=int, default=2)
    ap.add_argument("--corrupt", type=int, default=2)
    ap.add_argument("--timed-out", type=int, default=1)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    try:
        truth = plan_incident(
            args.ranks,
            local=args.local,
            scenario=args.scenario,
            fmt=args.format,
            seed=args.seed,
            odd=args.odd,
            missing_nodes=args.missing_nodes,
            missing_ranks=args.missing_ranks,
            corrupt=args.corrupt,
            timed_out=args.timed_out,
        )
    except ValueError as e:
        print(f"incident_gen: {e}", file=sys.stderr)
        return 2
    done = write_incident(args.out, truth, args.workers)
    size = sum(iter_sizes(args.out))
    print(json.dumps({**asdict(done), "bytes": size}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
