"""The model of a rank's threads: a thread is a list of frames, root first, of a Python or a
native kind; the paths of the libraries and sources they come from."""

from __future__ import annotations

from dataclasses import dataclass

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
class RankPlan:
    rank: int
    odd: int  # 0: ordinary; 1: checkpoint write; 2: waiting for data
    counter_shift: int  # added to every `Thread-N` number
    feeders: int
    seed: int
