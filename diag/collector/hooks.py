"""Instruments torch.distributed: every collective and point-to-point op becomes a journal record.

We patch the methods of `torch._C._distributed_c10d.ProcessGroup` rather than the functions of
`torch.distributed`. Every Python-level entry point (torch.distributed.all_reduce, DeepSpeed's
`deepspeed.comm`, which keeps its own references to torch functions, ZeRO's all_gather_into_tensor,
...) ends in one of these methods, so one patch sees them all, whenever it is applied.

Completion on CPU is seen when `Work.wait()` returns (sync ops wait at once) or, for async works
nobody has waited on yet, by polling `is_completed()` (completion.py). Future callbacks would also
do, but they run on the backend's thread and cost a GIL hand-off per op (~150 us measured on 2
gloo ranks). On CUDA, completion comes from events polled by a watcher thread (cuda.py), because
a CUDA future completes when the kernel is queued, not when it finishes.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diag.collector.completion import HostWorkTracker
from diag.formats.journalwriter import JournalWriter
from diag.formats.records import DType, OpCode, OpFlag, OpState

if TYPE_CHECKING:
    from diag.collector.cuda import CudaEventTracker

log = logging.getLogger(__name__)

# ProcessGroup method -> (op code, index of the argument whose tensors give the message size).
# The message size follows nccl-tests: the larger of input and output.
_METHODS: dict[str, OpCode] = {
    "allreduce": OpCode.ALL_REDUCE,
    "allreduce_coalesced": OpCode.ALL_REDUCE_COALESCED,
    "broadcast": OpCode.BROADCAST,
    "reduce": OpCode.REDUCE,
    "allgather": OpCode.ALL_GATHER,
    "_allgather_base": OpCode.ALL_GATHER_BASE,
    "all_gather_single": OpCode.ALL_GATHER_BASE,
    "allgather_coalesced": OpCode.ALL_GATHER_COALESCED,
    "allgather_into_tensor_coalesced": OpCode.ALL_GATHER_COALESCED,
    "all_gather_single_coalesced": OpCode.ALL_GATHER_COALESCED,
    "reduce_scatter": OpCode.REDUCE_SCATTER,
    "_reduce_scatter_base": OpCode.REDUCE_SCATTER_BASE,
    "reduce_scatter_single": OpCode.REDUCE_SCATTER_BASE,
    "reduce_scatter_tensor_coalesced": OpCode.REDUCE_SCATTER_COALESCED,
    "reduce_scatter_single_coalesced": OpCode.REDUCE_SCATTER_COALESCED,
    "alltoall": OpCode.ALL_TO_ALL,
    "alltoall_base": OpCode.ALL_TO_ALL_BASE,
    "all_to_all_single": OpCode.ALL_TO_ALL_BASE,
    "gather": OpCode.GATHER,
    "scatter": OpCode.SCATTER,
    "barrier": OpCode.BARRIER,
    "monitored_barrier": OpCode.MONITORED_BARRIER,
    "send": OpCode.SEND,
    "recv": OpCode.RECV,
    "recv_anysource": OpCode.RECV_ANYSOURCE,
}


@dataclass
class _Group:
    index: int
    ranks: tuple[int, ...]
    pg: Any = None  # a weak reference: a freed group's id may name a new group later
    seq: int = 0
    p2p_seq: dict[int, int] = field(default_factory=dict)


_P2P = frozenset(c for c in OpCode if c.is_p2p)
_DTYPES: dict[Any, DType] = {}  # torch dtype -> our code, filled on first sight


def _weak(pg: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(pg)
    except TypeError:  # a group object without weak references: held instead
        return lambda: pg


def _dtype_code(dtype: Any) -> DType:
    code = _DTYPES.get(dtype)
    if code is None:
        code = _DTYPES[dtype] = DType.from_name(str(dtype))
    return code


def _tensor_info(obj: Any, tensor_type: type[Any]) -> tuple[int, Any, bool]:
    """(bytes, torch dtype, on CUDA) of a tensor or of a (nested) list of tensors. Hot path."""
    if isinstance(obj, tensor_type):
        return obj.numel() * obj.element_size(), obj.dtype, obj.is_cuda
    if isinstance(obj, (list, tuple)) and obj:
        first = obj[0]
        if len(obj) == 1 and isinstance(first, tensor_type):
            return first.numel() * first.element_size(), first.dtype, first.is_cuda
        total, dtype, cuda = 0, None, False
        for item in obj:
            n, d, c = _tensor_info(item, tensor_type)
            total += n
            dtype = dtype or d
            cuda = cuda or c
        return total, dtype, cuda
    return 0, None, False


def _named(fn: Callable, qualname: str) -> Callable:
    """Names a wrapper like the method it stands in for. Stack dumps (py-spy reads the code
    object's qualified name) then show `Work.wait` where a rank waits in a collective, not our
    closure's `Instrumentation._wrap_wait.<locals>.wait`."""
    fn.__name__ = qualname.rsplit(".", 1)[-1]
    fn.__qualname__ = qualname
    fn.__code__ = fn.__code__.replace(co_name=fn.__name__, co_qualname=qualname)
    return fn


def _group_timeout_s(pg: Any, torch: Any) -> float:
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # backend absent for that device, or no options exposed
            continue
    return 0.0


class Instrumentation:
    """Owns the patches of one process. Create through `install`; `uninstall` restores torch."""

    def __init__(
        self,
        writer: JournalWriter,
        on_new_group: Callable[[int, Any, tuple[int, ...], float], None],
    ) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._tensor_type = torch.Tensor
        self._dist = dist
        self.writer = writer
        self._on_new_group = on_new_group
        self._groups: dict[int, _Group] = {}
        self._next_index = 0  # group indices are never reused within the journal
        self._lock = threading.Lock()
        self._originals: dict[tuple[type, str], Any] = {}
        self._cuda: CudaEventTracker | None = None  # created on the first CUDA op
        self._host = HostWorkTracker(writer)
        self.pg_timeout_s = 0.0
        self._paused = False

    # -- patching ----------------------------------------------------------------------------

    def install(self) -> None:
        # Keep the raw class attributes for uninstall: pybind11 stores methods as descriptors, and
        # what getattr returns (the unbound function) would not bind `self` if put back.
        c10d = self._torch._C._distributed_c10d
        pg_class, work_class = c10d.ProcessGroup, c10d.Work
        for name, code in _METHODS.items():
            if name not in vars(pg_class) or (pg_class, name) in self._originals:
                continue
            self._originals[(pg_class, name)] = vars(pg_class)[name]
            setattr(pg_class, name, self._wrap(getattr(pg_class, name), code))
        if (work_class, "wait") not in self._originals:
            self._originals[(work_class, "wait")] = vars(work_class)["wait"]
            work_class.wait = self._wrap_wait(work_class.wait)

    def uninstall(self) -> None:
        for (cls, name), raw in self._originals.items():
            setattr(cls, name, raw)
        self._originals.clear()

    def close(self) -> None:
        self.uninstall()
        if self._cuda is not None:
            self._cuda.stop()

    def forget_groups(self, *, pause: bool = False) -> None:
        """The world was formed again (in-place recovery): the groups seen so far are gone, and
        their successors get new indices, their sequence numbers counted from the start. With
        `pause`, ops go unrecorded until `resume` (see attach.new_world)."""
        with self._lock:
            self._groups = {}
            self._paused = pause

    def resume(self) -> None:
        self._paused = False

    def _wrap(self, orig: Callable, code: OpCode) -> Callable:
        def op(pg: Any, *args: Any, **kwargs: Any) -> Any:
            return self._run(orig, code, pg, args, kwargs)

        op.__wrapped__ = orig  # type: ignore[attr-defined]
        return _named(op, f"ProcessGroup.{getattr(orig, '__name__', code.label)}")

    def _wrap_wait(self, orig: Callable) -> Callable:
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                result = orig(work, *args, **kwargs)
            except BaseException:
                self._host.on_wait(work, failed=True)
                raise
            self._host.on_wait(work)
            if self._cuda is not None:
                self._cuda.on_wait(work)
            return result

        wait.__wrapped__ = orig  # type: ignore[attr-defined]
        return _named(wait, "Work.wait")

    # -- one op ------------------------------------------------------------------------------

    def _group(self, pg: Any) -> _Group:
        g = self._groups.get(id(pg))
        if g is not None and g.pg() is pg:
            return g
        with self._lock:
            g = self._groups.get(id(pg))
            if g is None or g.pg() is not pg:
                try:
                    ranks = tuple(self._dist.get_process_group_ranks(pg))
                except Exception:  # a group torch does not know (e.g. made outside c10d)
                    ranks = ()
                g = _Group(index=self._next_index, ranks=ranks, pg=_weak(pg))
                self._next_index += 1
                timeout = _group_timeout_s(pg, self._torch)
                if not self.pg_timeout_s:
                    self.pg_timeout_s = timeout
                self._on_new_group(g.index, pg, ranks, timeout)
                self._groups[id(pg)] = g
        return g

    def _run(self, orig: Callable, code: OpCode, pg: Any, args: tuple, kwargs: dict) -> Any:
        if self._paused:
            return orig(pg, *args, **kwargs)
        t0 = time.monotonic_ns()
        g = self._groups.get(id(pg))
        if g is None or g.pg() is not pg:
            g = self._group(pg)
        peer = -1
        flags = OpFlag.NONE
        if code in _P2P:
            flags |= OpFlag.P2P
            group_peer = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
            peer = g.ranks[group_peer] if 0 <= group_peer < len(g.ranks) else group_peer
            gseq = g.p2p_seq.get(peer, 0) + 1
            g.p2p_seq[peer] = gseq
        else:
            g.seq += 1
            gseq = g.seq
        tensor = self._tensor_type
        n0, dtype, cuda = _tensor_info(args[0], tensor) if args else (0, None, False)
        n1 = _tensor_info(args[1], tensor)[0] if len(args) > 1 else 0
        if cuda:
            flags |= OpFlag.CUDA
        seq = self.writer.append_op(
            code,
            _dtype_code(dtype) if dtype is not None else DType.NONE,
            flags,
            g.index,
            peer,
            gseq,
            n0 if n0 > n1 else n1,
            t0,
        )
        start_event = self._cuda_tracker().record_start() if cuda else None
        try:
            work = orig(pg, *args, **kwargs)
        except BaseException:
            self.writer.update(seq, OpState.FAILED, t_end_ns=time.monotonic_ns())
            raise
        if cuda:
            self._cuda_tracker().track(seq, work, start_event)
        elif work is not None:
            self._host.track(seq, work)
        else:
            # Inside a coalescing block the backend returns no work per op; the block's own
            # work covers it. We cannot observe it, so close the record now rather than leave
            # a phantom pending op.
            self.writer.update(seq, OpState.COMPLETED, t_end_ns=time.monotonic_ns())
        return work

    def _cuda_tracker(self) -> CudaEventTracker:
        if self._cuda is None:
            from diag.collector.cuda import CudaEventTracker

            self._cuda = CudaEventTracker(self.writer)
        return self._cuda
