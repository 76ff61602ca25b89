"""What `engine.save_checkpoint` would write, captured in memory instead of written to disk.

DeepSpeed routes every checkpoint file through its checkpoint engine (`engine.checkpoint_engine`
.save(state_dict, path)). For the length of one save we put a capturing engine in its place: each
state dict is pickled at once the way torch.save pickles it (tensors become references to their
storages, by key), and the storages themselves are kept by reference, to be copied into shared
memory afterwards. Nothing is cloned and nothing touches the disk. DeepSpeed's own control flow
(which rank writes which file, tag validation, barriers) runs unchanged.

Loading from memory goes the other way: a loading engine serves `load(path)` from a snapshot, and
DeepSpeed's `load_checkpoint` does the rest exactly as it would from disk.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.trainer.flash.unpickler import RestrictedUnpickler, check_pickle

TORCH_PICKLE_PROTOCOL = 2  # torch.save's default


@dataclass
class CapturedStorage:
    key: str
    storage: Any  # torch.UntypedStorage, on the CPU or a GPU
    nbytes: int


@dataclass
class CapturedFile:
    path: str  # relative to the save directory, with "/" separators
    kind: str  # "torch" or "raw"
    pickle: bytes = b""
    storages: list[CapturedStorage] = field(default_factory=list)
    data: bytes = b""
    mode: int = 0o644
    persist: bool = True

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.pickle) + sum(s.nbytes for s in self.storages)


def pickle_state(obj: Any) -> tuple[bytes, list[CapturedStorage]]:
    """Pickles `obj` as torch.save does (data.pkl of its zip format), keeping the storages apart."""
    import torch
    from torch.serialization import location_tag, normalize_storage_type

    keys: dict[int, str] = {}
    storages: list[CapturedStorage] = []
    dtypes: dict[int, Any] = {}

    def persistent_id(o: Any) -> tuple | None:
        if isinstance(o, torch.storage.TypedStorage):
            storage = o._untyped_storage
            dtype = o.dtype
            storage_type = getattr(torch, o._pickle_storage_type())
            numel = o._size()
        elif torch.is_storage(o):
            storage = o
            dtype = torch.uint8
            storage_type = normalize_storage_type(type(o))
            numel = storage.nbytes()
        else:
            return None
        ptr = storage.data_ptr()
        real = str(storage.device) != "meta" and ptr != 0
        if real and dtypes.setdefault(ptr, dtype) != dtype:
            raise RuntimeError(
                "cannot save multiple tensors or storages that view the same data as "
                "different types"
            )
        key = keys.get(storage._cdata)
        if key is None:
            key = keys[storage._cdata] = str(len(keys))
            storages.append(CapturedStorage(key, storage, storage.nbytes()))
        return ("storage", storage_type, key, location_tag(storage), numel)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> tuple | None:
            return persistent_id(o)

    buf = io.BytesIO()
    _Pickler(buf, protocol=TORCH_PICKLE_PROTOCOL).dump(obj)
    return buf.getvalue(), storages


def unpickle_state(
    data: bytes | memoryview,
    storage_bytes: Callable[[str], memoryview],
    map_location: Any = None,
    *,
    storages: Mapping[str, int],
    budget: int,
) -> Any:
    """The inverse of pickle_state: storages are copied out of `storage_bytes(key)` (shared memory
    may be overwritten by the next save, so nothing may alias it). The bytes are copied once and
    proven before they are loaded (trainer.unpickler.check_pickle: `storages`, key -> bytes the
    slot holds; `budget`, the slot's size): a refusal raises a RefusedPickle."""
    import numpy as np
    import torch
    from torch.serialization import default_restore_location

    raw = bytes(data)
    check_pickle(raw, storages=storages, budget=budget)
    loaded: dict[str, Any] = {}

    def restore(storage: Any, location: str) -> Any:
        if map_location is None:
            return default_restore_location(storage, location)
        if callable(map_location):
            result = map_location(storage, location)
            return storage if result is None else result
        return default_restore_location(storage, str(map_location))

    class _Unpickler(RestrictedUnpickler):
        def persistent_load(self, saved_id: Any) -> Any:
            typename, storage_type, key, location, numel = saved_id
            if typename != "storage":
                raise pickle.UnpicklingError(f"unknown persistent id {typename!r}")
            if isinstance(location, bytes):
                location = location.decode("ascii")
            if storage_type is torch.UntypedStorage:
                dtype = torch.uint8
            else:  # `_dtype` reads the same without TypedStorage's deprecation warning
                dtype = getattr(storage_type, "_dtype", None) or storage_type.dtype
            if key not in loaded:
                src = storage_bytes(key)
                t = torch.empty(len(src), dtype=torch.uint8)
                if len(src):
                    np.copyto(t.numpy(), np.frombuffer(src, dtype=np.uint8))
                loaded[key] = restore(t.untyped_storage(), location)
            storage = loaded[key]
            if numel * dtype.itemsize > storage.nbytes():
                raise pickle.UnpicklingError(f"storage {key} is shorter than its tensors")
            return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    return _Unpickler(io.BytesIO(raw)).load()


def _checkpoint_engine_base() -> type:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    return CheckpointEngine


def capture_engine(save_dir: str, sink: Callable[[str, Any], None]) -> Any:
    """A DeepSpeed checkpoint engine that hands every (relative path, state dict) to `sink`."""
    base = _checkpoint_engine_base()

    class CaptureEngine(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(None)
            self.name = "DiagFlashCapture"

        def create(self, info: Any) -> None:
            pass

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            pass  # nothing goes to disk here; the agent creates directories when it persists

        def save(self, state_dict: Any, path: str) -> None:
            sink(relative(save_dir, path), state_dict)

        def load(self, path: str, map_location: Any = None) -> Any:
            raise RuntimeError("the flash capture engine only saves")

        def commit(self, info: Any) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            # Storages are captured whole, as torch.save writes them, and copied once into
            # shared memory: DeepSpeed need not clone tensors first.
            return False

    return CaptureEngine()


def loading_engine(load_dir: str, load: Callable[[str, Any], Any]) -> Any:
    """A DeepSpeed checkpoint engine whose `load(path)` returns `load(relative path, map_location)`."""
    base = _checkpoint_engine_base()

    class MemoryLoadEngine(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(None)
            self.name = "DiagFlashLoad"

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            raise RuntimeError("the flash load engine only loads")

        def load(self, path: str, map_location: Any = None) -> Any:
            return load(relative(load_dir, path), map_location)

        def commit(self, info: Any) -> bool:
            return True

    return MemoryLoadEngine()


def relative(base: str, path: str) -> str:
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(base))
    if rel.startswith(".."):
        raise ValueError(f"{path} is outside the checkpoint directory {base}")
    return rel.replace(os.sep, "/")


@contextlib.contextmanager
def swapped_engine(engine: Any, replacement: Any) -> Iterator[None]:
    """Puts `replacement` in place of the engine's checkpoint engine, and DeepSpeed's copy of its
    recovery scripts (zero_to_fp32.py) under our control, for the length of the block."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = replacement
    try:
        yield
    finally:
        engine.checkpoint_engine = original


@contextlib.contextmanager
def captured_copies(sink: Callable[[str, str], None]) -> Iterator[None]:
    """Routes DeepSpeed's `copyfile(src, dst)` (the recovery scripts it copies next to a
    checkpoint) to `sink` instead of the disk."""
    import deepspeed.runtime.engine as ds_engine

    original = getattr(ds_engine, "copyfile", None)
    if original is None:  # another DeepSpeed layout: the scripts are simply not captured
        yield
        return
    ds_engine.copyfile = sink
    try:
        yield
    finally:
        ds_engine.copyfile = original


def capture_checkpoint(
    engine: Any,
    save_dir: str,
    tag: str,
    client_state: dict[str, Any],
    *,
    replica: bool = False,
    scripts: dict[str, bytes] | None = None,
) -> list[CapturedFile]:
    """Runs `engine.save_checkpoint(save_dir, tag)` with nothing written: returns the files it
    would write on this rank. With `replica`, a rank that DeepSpeed would not let write the model
    states captures them too, as a node-local copy that is not persisted. Collective."""
    files: list[CapturedFile] = []
    cache = scripts if scripts is not None else {}

    def sink(rel: str, state_dict: Any) -> None:
        data, storages = pickle_state(state_dict)
        files.append(CapturedFile(rel, "torch", data, storages))

    def copied(src: str, dst: str) -> None:
        data = cache.get(src)
        if data is None:
            data = cache[src] = Path(src).read_bytes()
        files.append(CapturedFile(relative(save_dir, dst), "raw", data=data, mode=0o755))

    writer = engine.save_non_zero_checkpoint
    replica = replica and not writer
    engine.save_non_zero_checkpoint = writer or replica
    try:
        with swapped_engine(engine, capture_engine(save_dir, sink)), captured_copies(copied):
            engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    finally:
        engine.save_non_zero_checkpoint = writer
    if replica:
        model = relative(save_dir, engine._get_ckpt_name(save_dir, tag))
        for f in files:
            if f.path == model:
                f.persist = False  # a node-local copy; DeepSpeed's writer persists its own
    return files
