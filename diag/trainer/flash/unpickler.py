"""Loading a checkpoint's pickle from a snapshot slot: proven first, then unpickled for real.

A slot lives in a directory other users may be able to write, and unpickling runs whatever
callable the pickle names, allocates what its numbers say, and BUILD sets attributes on whatever
it is given. So before the trainer unpickles a slot's bytes it proves, on those very bytes (a
private copy: shared memory could change in between), that loading them does only what a
DeepSpeed checkpoint does: only protocol 2's opcodes, with arguments inside the pickle
(picklescan.py), only allowed globals (allowlist.py), called only as checkpoints call them, no
BUILD on a class or a global, and no more allocated in all than the slot holds (pickleproof.py).
Each refusal is a pickle.UnpicklingError (refused.py) saying what was seen.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

from diag.trainer.flash.allowlist import ALLOWED as ALLOWED
from diag.trainer.flash.allowlist import allowed
from diag.trainer.flash.pickleproof import Budget, canonical, prove
from diag.trainer.flash.picklescan import scan
from diag.trainer.flash.refused import RefusedBuild as RefusedBuild
from diag.trainer.flash.refused import RefusedCall as RefusedCall
from diag.trainer.flash.refused import RefusedGlobal as RefusedGlobal
from diag.trainer.flash.refused import RefusedOpcode as RefusedOpcode
from diag.trainer.flash.refused import RefusedPickle as RefusedPickle
from diag.trainer.flash.refused import RefusedSize as RefusedSize


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler (the C one) that resolves allowed globals only. For bytes that
    check_pickle passed."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = canonical(module, name)
        if not allowed(module, name):
            raise RefusedGlobal(module, name)
        return super().find_class(module, name)


def check_pickle(data: bytes, *, storages: Mapping[str, int], budget: int) -> None:
    """Raises a RefusedPickle when loading `data` would do what a checkpoint never does, or
    allocate more than `budget` bytes in all (the slot's size); another pickle.UnpicklingError
    when it is malformed. `storages`: the slot's storages of this file, key -> bytes."""
    scan(data)
    prove(data, storages, Budget(budget))
