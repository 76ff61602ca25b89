"""Why the trainer refuses a pickle from a snapshot slot: every reason is a pickle.UnpicklingError,
so whoever loads a slot handles a refusal like a malformed pickle, and each says what was seen."""

from __future__ import annotations

import pickle


class RefusedPickle(pickle.UnpicklingError):
    """A pickle does what a DeepSpeed checkpoint written by the trainer never does."""


class RefusedGlobal(RefusedPickle):
    """A pickle names a global outside the allow-list."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        super().__init__(
            f"refers to {module}.{name}, which a DeepSpeed checkpoint never holds; not loaded"
        )


class RefusedOpcode(RefusedPickle):
    """An opcode torch.save's protocol 2 never writes, or one whose argument lies outside the
    pickle (a length past its end, a memo index past what was stored)."""


class RefusedBuild(RefusedPickle):
    """BUILD on what a checkpoint never gives state: a class or another global (it would change
    it for the whole process), or attributes that would shadow the methods of an instance."""


class RefusedCall(RefusedPickle):
    """A call of an allowed global with arguments a checkpoint never passes it."""


class RefusedSize(RefusedPickle):
    """What the pickle would allocate is more than its slot holds."""

    def __init__(self, what: str, nbytes: int, limit: int) -> None:
        self.nbytes, self.limit = nbytes, limit
        super().__init__(
            f"{what} would take {nbytes} bytes, more than the {limit} bytes its slot holds in all"
        )
