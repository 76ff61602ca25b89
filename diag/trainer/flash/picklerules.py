"""What a checkpoint calls, and with what: one rule per allowed global, run by its stand-in during
a pickle's proof (pickleproof.py). A rule checks the arguments (a tensor view inside its
storage, a dtype that is a name, bytes written as latin1), charges what the real call would
allocate, and returns the stand-in of what it would make.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
from collections.abc import Callable
from typing import Any

from diag.trainer.flash.picklestandins import (
    ELEMENT,
    MAX_DIMS,
    MAX_TEXT,
    Global,
    Made,
    attribute_state,
    charge,
    class_standin,
    describe,
    ints,
    scalars,
    short,
    sized,
)
from diag.trainer.flash.refused import RefusedCall

TENSOR = Made("a tensor", "tensor")  # what a rebuild makes: nothing in it is checked later


def _view(where: str, args: tuple) -> Made:
    """A tensor over a storage: (storage, offset, size, stride, ...) must lie inside it. Run
    for every tensor of a checkpoint: kept to plain loops."""
    if not 4 <= len(args) <= 8:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    storage, offset, size, stride = args[0], args[1], args[2], args[3]
    if type(storage) is not Made or storage.kind != "storage":
        raise RefusedCall(f"{where} of {describe(storage)}, not of a storage")
    if type(size) is not tuple or type(stride) is not tuple:
        size, stride = ints(size, where, "size"), ints(stride, where, "stride")
    if type(offset) is not int or offset < 0 or len(size) != len(stride) or len(size) > MAX_DIMS:
        raise RefusedCall(
            f"{where}: size {short(size)}, stride {short(stride)}, offset {short(offset)}"
        )
    numel, end = 1, offset + 1
    for n, step in zip(size, stride, strict=True):
        if type(n) is not int or type(step) is not int or n < 0 or step < 0:
            raise RefusedCall(f"{where}: size {short(size)}, stride {short(stride)}")
        numel *= n
        end += (n - 1) * step
    if numel and end > storage.size:
        raise RefusedCall(
            f"{where}: a tensor of size {size} reaches element {end} of a storage of {storage.size}"
        )
    return TENSOR


def _tensor_of(x: Any, where: str) -> Made:
    if not (isinstance(x, Made) and x.kind == "tensor"):
        raise RefusedCall(f"{where} of {describe(x)}, not of a tensor")
    return x


def _parameter(where: str, args: tuple) -> Made:
    if len(args) != 3:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    return _tensor_of(args[0], where)


def _parameter_with_state(where: str, args: tuple) -> Made:
    if len(args) != 4:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    import torch

    attribute_state(torch.nn.Parameter, args[3], "a parameter")
    return _tensor_of(args[0], where)


def _from_numpy(where: str, args: tuple) -> Made:
    if len(args) != 4 or not (isinstance(args[0], Made) and args[0].kind == "array"):
        raise RefusedCall(f"{where} of {describe(args[0] if args else None)}, not of an array")
    charge(ELEMENT * args[0].size, where)  # converted to its dtype: at most 16 bytes an item
    return TENSOR


def _meta(where: str, args: tuple) -> Made:
    if len(args) != 4:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    sizes, strides = ints(args[1], where, "size"), ints(args[2], where, "stride")
    if len(sizes) != len(strides):
        raise RefusedCall(f"{where}: size {sizes}, stride {strides}")
    return TENSOR  # on the meta device: nothing allocated


_TENSOR_REBUILDS: dict[str, Callable[[str, tuple], Any]] = {
    "_rebuild_tensor": _view,
    "_rebuild_tensor_v2": _view,
    "_rebuild_tensor_v3": _view,
    "_rebuild_parameter": _parameter,
    "_rebuild_parameter_with_state": _parameter_with_state,
    "_rebuild_device_tensor_from_numpy": _from_numpy,
    "_rebuild_meta_tensor_no_storage": _meta,
}


def _from_type(where: str, args: tuple) -> Made:
    """torch._tensor._rebuild_from_type_v2(func, new_type, args, state): one of the rebuilds
    above, on a tensor type, with attributes set on the tensor."""
    if len(args) != 4:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    func, new_type, func_args, state = args
    name = func.where.rpartition(".")[2] if isinstance(func, Global) else ""
    if name not in _TENSOR_REBUILDS or not isinstance(func_args, tuple):
        raise RefusedCall(f"{where} of {describe(func)}, not of a tensor rebuild")
    import torch

    real = getattr(new_type, "_real", None) if isinstance(new_type, type) else None
    if not (isinstance(real, type) and issubclass(real, torch.Tensor)):
        raise RefusedCall(f"{where} to {describe(new_type)}, not to a tensor type")
    made = func(*func_args)
    attribute_state(real, state, f"a {real.__name__}")
    return made


def _reconstruct(where: str, args: tuple) -> Made:
    if len(args) != 3:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    import numpy

    subtype, shape, dtype = args
    if getattr(subtype, "_real", None) is not numpy.ndarray:
        raise RefusedCall(f"{where} of {describe(subtype)}, not of numpy.ndarray")
    if not isinstance(dtype, str | bytes) or len(dtype) > MAX_TEXT:
        raise RefusedCall(f"{where} with dtype {describe(dtype)}")
    nbytes = math.prod(ints(shape, where, "shape")) * numpy.dtype(dtype).itemsize
    charge(nbytes, where)
    return Made(f"an array from {where}", "array", nbytes)


def _scalar(where: str, args: tuple) -> Made:
    if not 1 <= len(args) <= 2:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    if len(args) == 2 and isinstance(args[1], bytes | Made):
        charge(sized(args[1], where), where)
    return Made(f"a numpy scalar from {where}", "value")


def _encode(where: str, args: tuple) -> bytes:
    """`_codecs.encode(text, "latin1")`: how protocol 2 writes bytes. Made for real (charged):
    later checks need their value (a dtype's name) or length (an array's data)."""
    if not 1 <= len(args) <= 3 or not isinstance(args[0], str):
        raise RefusedCall(f"{where} of {describe(args[0] if args else None)}, not of a string")
    if len(args) == 1 or args[1] not in ("latin1", "latin-1"):
        raise RefusedCall(f"{where} to {short(args[1:2])}: protocol 2 writes bytes as latin1 only")
    charge(len(args[0]), where)
    return args[0].encode("latin-1")


def _size(where: str, args: tuple) -> Made:
    dims = ints(args[0], where, "its dimensions") if args else ()
    if len(args) > 1:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    charge(ELEMENT * len(dims), where)
    return Made(f"a {where}", "value", value=dims)


def _small(where: str, args: tuple) -> Made:
    """Calls that make a small value out of scalars (devices, slices, complex numbers)."""
    if len(args) > 3:
        raise RefusedCall(f"{where} called with {len(args)} arguments")
    scalars(args, where)
    return Made(f"a {where}", "value")


def _range(where: str, args: tuple) -> Made:
    if not 1 <= len(args) <= 3 or not all(isinstance(a, int) for a in args):
        raise RefusedCall(f"{where} of {short(args)}")
    try:
        n = len(range(*args))
    except (OverflowError, ValueError) as e:
        raise RefusedCall(f"{where} of {short(args)}: {e}") from None
    return Made(f"a {where}", "sized", n)  # never expanded here: its copies are charged


def _container(obj: Made, args: tuple) -> None:
    """OrderedDict, set, frozenset, deque: copies of what they are given."""
    obj.kind = "container"
    if args:
        obj.size = sized(args[0], type(obj)._where)
        charge(ELEMENT * obj.size, type(obj)._where)
    if len(args) > 2 or (len(args) == 2 and not isinstance(args[1], int | None)):
        raise RefusedCall(f"{type(obj)._where} called with {short(args)}")


def _defaultdict(obj: Made, args: tuple) -> None:
    obj.kind = "container"
    factory = args[0] if args else None
    if not (factory is None or isinstance(factory, Global | type)):
        raise RefusedCall(f"collections.defaultdict with the factory {describe(factory)}")
    if len(args) > 1:
        _container(obj, args[1:])


def _bytearray(obj: Made, args: tuple) -> None:
    obj.kind = "bytes"
    if args:
        n = args[0] if isinstance(args[0], int) else sized(args[0], "builtins.bytearray")
        if n < 0 or len(args) > 3:
            raise RefusedCall(f"builtins.bytearray of {short(args)}")
        charge(n, "builtins.bytearray")
        obj.size = n


def _instance(obj: Made, args: tuple) -> None:
    """Classes whose objects hold data attributes: made empty, then given their state."""
    scalars(args, type(obj)._where)


def _value(obj: Made, args: tuple) -> None:
    obj.kind = "value"
    scalars(args, type(obj)._where)


def _dtype(obj: Made, args: tuple) -> None:
    """numpy.dtype(name, align, copy=True), as numpy pickles a dtype: without the copy numpy
    hands out its own dtype of that name, shared by the whole process, which a BUILD after it
    would change."""
    obj.kind = "dtype"
    if len(args) != 3 or not isinstance(args[0], str | bytes) or len(args[0]) > MAX_TEXT:
        raise RefusedCall(f"numpy.dtype of {short(args)}")
    if type(args[1]) is not bool or args[2] is not True:
        raise RefusedCall(f"numpy.dtype of {short(args)}: not a copy of its own")
    obj.value = (args[0], args[1])  # what its state is checked against


_FUNCTIONS: dict[tuple[str, str], Callable[[str, tuple], Any]] = {
    **{("torch._utils", name): rule for name, rule in _TENSOR_REBUILDS.items()},
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type,
    ("_codecs", "encode"): _encode,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "scalar"): _scalar,
    ("numpy.core.multiarray", "scalar"): _scalar,
}
_CLASSES: dict[tuple[str, str], Callable[[Made, tuple], None]] = {
    ("collections", "OrderedDict"): _container,
    ("collections", "defaultdict"): _defaultdict,
    ("collections", "deque"): _container,
    ("builtins", "set"): _container,
    ("builtins", "frozenset"): _container,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "slice"): _value,
    ("builtins", "complex"): _value,
    ("argparse", "Namespace"): _instance,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _instance,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _instance,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _instance,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _value,
    ("numpy", "dtype"): _dtype,
}
_CLASS_FUNCTIONS = {
    ("torch", "Size"): _size,
    ("torch", "device"): _small,
    ("builtins", "range"): _range,
}


@functools.lru_cache(maxsize=256)
def standin(module: str, name: str) -> Any:
    """The stand-in of an allowed global: a Made subclass for a class, a Global otherwise.
    Classes with no rule (storage types, tensor types, numpy.ndarray, the builtins a
    defaultdict names as its factory) are named by checkpoints, never called."""
    real = pickle.Unpickler(io.BytesIO(b"")).find_class(module, name)
    where = f"{module}.{name}"
    if (module, name) in _CLASS_FUNCTIONS:  # types whose calls make a plain value
        return Global(where, _CLASS_FUNCTIONS[module, name])
    if isinstance(real, type):  # numpy.dtypes' classes too: calling one gives numpy's own dtype
        return class_standin(where, real, _CLASSES.get((module, name)))
    return Global(where, _FUNCTIONS.get((module, name)))
