"""Which globals a checkpoint's pickled structure may name, for loading slots from shared memory.

A slot lives in a directory other users may be able to write, and unpickling runs whatever
callable the pickle names. So the trainer resolves only the globals DeepSpeed checkpoints hold
(listed from the pickles of real ZeRO 1, 2 and 3 checkpoints, fp32 and bf16, with numpy and
Python RNG state in the client state): torch's tensor and storage rebuilders, dtypes, devices,
sizes, containers, numpy arrays and scalars, and DeepSpeed's own small config types. Anything else
(os.system, builtins.eval, subprocess.Popen...) is refused before it is resolved. What each
allowed global may be called with is pickleproof.py's.
"""

from __future__ import annotations

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
