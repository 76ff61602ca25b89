"""The proof that a slot's pickle may be loaded: the real (C) unpickler runs over it once with
every global replaced by an inert stand-in that checks what the pickle does with it, before the
trainer loads the same bytes for real.

A stand-in knows which global it replaces and what a checkpoint does with that global; the
objects calls make are stand-ins too, carrying what later checks need (a storage's length, a
container's count, the bytes a call made). So, without rebuilding a tensor:
- a global outside the allow-list is refused (RefusedGlobal);
- BUILD on a class or another global is refused: it would set attributes of the class, the
  dtype or the function for the whole process. BUILD on an instance of a class without its own
  `__setstate__` (argparse.Namespace, DeepSpeed's loss scalers, fragment addresses, OrderedDict)
  may set data attributes only: not dunders, not names of the class's methods or properties
  (a checkpoint carries values, never behaviour for DeepSpeed to call later), no slot state
  (setattr);
- every call must get the arguments a checkpoint gives it, and whatever it would allocate is
  charged to a budget, the bytes the slot holds: a tensor view must lie inside its storage, a
  storage key must be one the slot describes (its bytes charged once), `bytearray(3 GiB)`,
  `list(range(10**9))` or a thousand copies of one big list are refused before anything is
  allocated. Globals a checkpoint only names (storage types, `torch.Tensor` for a rebuild,
  `list` as a defaultdict's factory) are never called.
What opcodes alone build is linear in the pickle's length (picklescan.py).
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Mapping
from typing import Any

from diag.trainer.flash.allowlist import allowed
from diag.trainer.flash.picklerules import standin
from diag.trainer.flash.picklestandins import Budget, Made, Proof, current, describe, short
from diag.trainer.flash.refused import RefusedCall, RefusedGlobal, RefusedPickle

__all__ = ["Budget", "canonical", "prove"]


@functools.lru_cache(maxsize=64)
def _storage_itemsize(standin: Any) -> int | None:
    real = getattr(standin, "_real", None) if isinstance(standin, type) else None
    if real is None:
        return None
    import torch

    if real is torch.UntypedStorage:
        return 1
    if issubclass(real, torch.storage._LegacyStorage):
        return int(real._dtype.itemsize)
    return None


class _Prover(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        module, name = canonical(module, name)
        if not allowed(module, name):
            raise RefusedGlobal(module, name)
        return standin(module, name)

    def persistent_load(self, pid: Any) -> Made:
        proof: Proof = current.proof
        try:
            return proof.pids[pid]  # the same storage, for another tensor: checked already
        except (KeyError, TypeError):
            pass
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise RefusedCall(f"persistent id {short(pid)}: torch.save writes storages only")
        _, storage_type, key, _location, numel = pid
        itemsize = _storage_itemsize(storage_type)
        if itemsize is None:
            raise RefusedCall(f"a storage of {describe(storage_type)}, not of a storage type")
        nbytes = proof.storages.get(key) if isinstance(key, str) else None
        if nbytes is None:
            raise RefusedCall(f"storage {short(key)} is not one the slot holds")
        if not isinstance(numel, int) or not 0 <= numel * itemsize <= nbytes:
            raise RefusedCall(f"storage {key} of {short(numel)} items, {nbytes} bytes in the slot")
        found = proof.loaded.get((key, itemsize))
        if found is None:
            if key not in proof.copied:
                proof.copied.add(key)
                proof.budget.charge(nbytes, f"storage {key}")  # copied out once
            found = proof.loaded[key, itemsize] = Made(
                f"storage {key}", "storage", nbytes // itemsize
            )
        proof.pids[pid] = found
        return found


def canonical(module: str, name: str) -> tuple[str, str]:
    """Python 2's names, which protocol 2 writes for builtins (`__builtin__.set`), as Python 3
    resolves them (what the unpickler's own find_class does for protocols below 3)."""
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[module, name]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def prove(data: bytes, storages: Mapping[str, int], budget: Budget) -> None:
    """Runs `data` with stand-ins (picklescan.scan must have passed it). Raises a RefusedPickle
    saying what a checkpoint never does, another pickle.UnpicklingError when it is malformed."""
    current.proof = Proof(budget, storages)
    try:
        _Prover(io.BytesIO(data)).load()
    except RefusedPickle:
        raise
    except Exception as e:  # stand-ins run nothing: any other error means a malformed pickle
        raise pickle.UnpicklingError(f"is not a valid pickle: {type(e).__name__}: {e}") from None
    finally:
        current.proof = None
