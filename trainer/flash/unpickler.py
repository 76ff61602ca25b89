"""Which globals a checkpoint's pickled structure may name, for loading slots from shared memory.

A slot lives in a directory other users may be able to write, and unpickling runs whatever
callable the pickle names. So the trainer resolves only the globals DeepSpeed checkpoints hold
(listed from the pickles of real ZeRO 1, 2 and 3 checkpoints, fp32 and bf16, with numpy and
Python RNG state in the client state): torch's tensor and storage rebuilders, dtypes, devices,
sizes, containers, numpy arrays and scalars, and DeepSpeed's own small config types. Anything else
(os.system, builtins.eval, subprocess.Popen...) is refused before it is resolved.

`check_globals` runs a pickle with every global replaced by an inert stand-in: it proves, at the
cost of one pass over the structure and without touching a tensor, that loading it will not be
refused, so a refused slot can be left out before the ranks agree on where to resume from.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"),
        ("torch._utils", "_rebuild_meta_tensor_no_storage"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch", "Tensor"),
        ("torch", "UntypedStorage"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.nn.parameter", "Parameter"),
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("builtins", "bytearray"),
        ("builtins", "range"),
        # defaultdict factories
        ("builtins", "list"),
        ("builtins", "dict"),
        ("builtins", "int"),
        ("builtins", "float"),
        ("builtins", "str"),
        ("builtins", "tuple"),
        ("_codecs", "encode"),  # protocol 2 writes bytes as _codecs.encode(text, "latin1")
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("argparse", "Namespace"),
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
    }
)


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        super().__init__(
            f"refers to {module}.{name}, which a DeepSpeed checkpoint never holds; not loaded"
        )


def allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED:
        return True
    if module == "numpy.dtypes" and name.endswith("DType"):
        return True  # numpy 2 pickles dtypes by their class
    if module != "torch" or name.startswith("_"):
        return False
    import torch

    obj = getattr(torch, name, None)
    if isinstance(obj, torch.dtype):
        return True  # torch.float32 and friends are pickled by name
    # Storage types name the dtype of a tensor's storage (torch.FloatStorage...).
    return isinstance(obj, type) and issubclass(obj, torch.storage._LegacyStorage)


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler (the C one) that resolves allowed globals only."""

    def find_class(self, module: str, name: str) -> Any:
        if not allowed(module, name):
            raise RefusedGlobal(module, name)
        return super().find_class(module, name)


class _Inert:
    """Stands in for every global and storage during `check_globals`: accepts whatever the
    pickle does with it (calls, NEWOBJ, BUILD, appends, item sets)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Checker(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not allowed(module, name):
            raise RefusedGlobal(module, name)
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple):  # the storage type is a global too: it was checked already
            return _Inert()
        raise pickle.UnpicklingError("unknown persistent id")


def check_globals(data: bytes | memoryview) -> None:
    """Raises RefusedGlobal when the pickle names a global outside the allow-list, another
    pickle.UnpicklingError when it is malformed."""
    try:
        _Checker(io.BytesIO(bytes(data))).load()
    except RefusedGlobal:
        raise
    except Exception as e:  # everything it runs is inert: any error means a malformed pickle
        raise pickle.UnpicklingError(f"is not a valid pickle: {type(e).__name__}: {e}") from None
