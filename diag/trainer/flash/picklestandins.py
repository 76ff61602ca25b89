"""The inert stand-ins of a pickle's proof (pickleproof.py): what stands in for the globals a
pickle names and for the objects their calls make, and what BUILD may do to each.

A class the pickle names is replaced by a subclass of Made (NEWOBJ needs a type), a function or
another global by a Global; what a call makes is a Made saying what it is, as far as the checks
need (a storage's length, a container's count, the bytes made). BUILD looks `__setstate__` up:
on a class or a Global it refuses (the attributes would be set for the whole process); on a
Made it lets only what a checkpoint does pass. Allocations are charged to the proof's Budget.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import reprlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from diag.trainer.flash.refused import RefusedBuild, RefusedCall, RefusedSize

ELEMENT = 16  # bytes charged per element a call puts in a new container (a pointer, a table slot)
MAX_DIMS = 64
MAX_ARGS = 16
MAX_TEXT = 1024  # a dtype's or a device's name, a complex number's text


class Budget:
    """Bytes the calls of one pickle may allocate in all."""

    def __init__(self, limit: int) -> None:
        self.limit, self.spent = limit, 0

    def charge(self, nbytes: int, what: str) -> None:
        self.spent += nbytes
        if self.spent > self.limit:
            raise RefusedSize(what, nbytes, self.limit)


class Proof:
    def __init__(self, budget: Budget, storages: Mapping[str, int]) -> None:
        self.budget = budget
        self.storages = storages  # key -> bytes the slot holds for it
        self.loaded: dict[tuple[str, int], Made] = {}  # (key, item size) -> its stand-in
        self.copied: set[str] = set()  # keys charged (the real load copies each out once)
        self.pids: dict[Any, Made] = {}  # persistent ids seen, and what they stand for


current = threading.local()


def charge(nbytes: int, what: str) -> None:
    current.proof.budget.charge(nbytes, what)


# -- the stand-ins ------------------------------------------------------------------------------


class _SetState:
    """`__setstate__` of every stand-in: looked up on an instance (BUILD on what a call made) it
    checks the state; looked up on a class (BUILD on a class the pickle named) it refuses."""

    def __get__(self, obj: Any, owner: type | None = None) -> Callable[[Any], None]:
        if obj is None:
            return functools.partial(_build_on_class, owner)
        return obj._build


def _build_on_class(cls: Any, state: Any) -> None:
    raise RefusedBuild(
        f"BUILD on the class {cls._where} itself would set {_keys(state)} on it for the whole "
        "process; a checkpoint gives state to the objects it makes, never to a class"
    )


def _keys(state: Any) -> str:
    parts = state if isinstance(state, tuple) else (state,)
    names = [short(k) for p in parts if isinstance(p, dict) for k in itertools.islice(p, 5)]
    return "attributes " + ", ".join(names) if names else "its state"


class Made:
    """An object a call (or NEWOBJ) made, as far as the checks need it. `kind`: tensor,
    storage, bytes, sized (a range), container, instance, array, dtype or value."""

    _where = "an object"
    _real: Any = None  # the class, for objects a class stand-in made

    def __init__(self, what: str = "", kind: str = "value", size: int = 0, value: Any = None):
        self.what, self.kind, self.size, self.value = what, kind, size, value

    __setstate__ = _SetState()

    def _build(self, state: Any) -> None:
        if self.kind in ("instance", "container"):
            real = type(self)._real
            if hasattr(real, "__setstate__"):  # the class's own code takes it
                charge(ELEMENT * count(state), f"the state of {self.what}")
            else:
                attribute_state(real, state, self.what)
        elif self.kind == "dtype":
            dtype_state(state, self.value)
        elif self.kind == "array":
            self.size = array_state(state)
        else:
            raise RefusedBuild(f"BUILD on {self.what}: a checkpoint never gives one state")

    def __setitem__(self, key: Any, value: Any) -> None:
        self._add(1)

    def append(self, value: Any) -> None:
        self._add(1)

    def extend(self, values: Any) -> None:
        self._add(len(values))

    def _add(self, n: int) -> None:
        if self.kind != "container":
            raise RefusedCall(f"items added to {self.what}: a checkpoint adds items to containers")
        self.size += n


class Global:
    """A function or value global the pickle named (a class's stand-in is a Made subclass)."""

    def __init__(self, where: str, rule: Callable[[str, tuple], Any] | None) -> None:
        self.where, self.rule = where, rule

    def __call__(self, *args: Any, **kwargs: Any) -> Made:
        if self.rule is None:
            raise RefusedCall(f"{self.where} is named in checkpoints, never called")
        return self.rule(self.where, args)

    __setstate__ = _SetState()

    def _build(self, state: Any) -> None:
        raise RefusedBuild(
            f"BUILD on {self.where}, a global, would set {_keys(state)} for the whole process"
        )

    def __setitem__(self, key: Any, value: Any) -> None:
        raise RefusedCall(f"items added to {self.where}, a global")


def class_standin(where: str, real: type, rule: Callable[[Made, tuple], None] | None) -> type:
    def new(cls: type, *args: Any, **kwargs: Any) -> Made:
        obj: Made = object.__new__(cls)
        obj.what, obj.kind, obj.size, obj.value = f"a {where}", "instance", 0, None
        if rule is None:
            raise RefusedCall(f"{where} is named in checkpoints, never called")
        if len(args) > MAX_ARGS:
            raise RefusedCall(f"{where} called with {len(args)} arguments")
        rule(obj, args)
        return obj

    def init(self: Made, *args: Any, **kwargs: Any) -> None:
        pass

    ns = {"__new__": new, "__init__": init, "_real": real, "_where": where}
    return type(where.rpartition(".")[2], (Made,), ns)


def count(x: Any) -> int:
    if isinstance(x, str | bytes | bytearray | list | tuple | dict | set | frozenset):
        return len(x)
    if isinstance(x, Made) and x.kind in ("bytes", "sized", "container"):
        return x.size
    return 1


def sized(x: Any, where: str) -> int:
    if isinstance(x, str | bytes | bytearray | list | tuple | dict | set | frozenset):
        return len(x)
    if isinstance(x, Made) and x.kind in ("bytes", "sized", "container"):
        return x.size
    raise RefusedCall(f"{where} of {describe(x)}, whose length the checkpoint states nowhere")


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 40


def short(x: Any) -> str:
    """A value from the pickle in an error message: bounded, however big or deep it is."""
    return _SHORT.repr(x)


def describe(x: Any) -> str:
    if isinstance(x, Made):
        return x.what
    if isinstance(x, Global):
        return x.where
    if isinstance(x, type) and issubclass(x, Made):
        return f"the class {x._where}"
    return f"a {type(x).__name__}"


def ints(x: Any, where: str, what: str) -> tuple[int, ...]:
    if isinstance(x, Made) and x.kind == "value" and isinstance(x.value, tuple):
        x = x.value  # a torch.Size
    if not isinstance(x, tuple | list) or len(x) > MAX_DIMS:
        raise RefusedCall(f"{where}: {what} must be up to {MAX_DIMS} integers, not {describe(x)}")
    for n in x:
        if not isinstance(n, int) or n < 0:
            raise RefusedCall(f"{where}: {what} holds {short(n)}, not a count")
    return tuple(x)


def scalars(args: tuple, where: str) -> None:
    for a in args:
        if a is None or isinstance(a, bool | int | float):
            continue
        if not isinstance(a, str) or len(a) > MAX_TEXT:
            raise RefusedCall(f"{where} called with {describe(a)}")


def attribute_state(real: type, state: Any, what: str) -> None:
    """What default BUILD (or torch's `_set_obj_state`) does with `state` on an object of class
    `real`: set attributes. Only data attributes pass, charged by their count."""
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if slots:
        raise RefusedBuild(f"slot state for {what}: its attributes would be set with setattr")
    if state is None:
        return
    if not isinstance(state, dict):
        raise RefusedBuild(f"state of {what} is {describe(state)}, not a dict of attributes")
    for key in state:
        if not isinstance(key, str) or _shadows(real, key):
            raise RefusedBuild(
                f"attribute {short(key)} of {what} would shadow a method or special name of "
                f"{real.__module__}.{real.__qualname__}; a checkpoint sets data attributes only"
            )
    charge(ELEMENT * len(state), f"the state of {what}")


@functools.lru_cache(maxsize=4096)
def _shadows(real: type, key: str) -> bool:
    if key.startswith("__") and key.endswith("__"):
        return True
    attr = inspect.getattr_static(real, key, None)
    return attr is not None and (callable(attr) or hasattr(type(attr), "__get__"))


def array_state(state: Any) -> int:
    """numpy.ndarray.__setstate__((version, shape, dtype, is_fortran, data)): numpy checks that
    raw bytes match the shape before it allocates, but an object array's list only after."""
    if not isinstance(state, tuple) or len(state) not in (4, 5):
        raise RefusedBuild(f"an array's state is {describe(state)}")
    if len(state) == 5 and type(state[0]) is not int:
        raise RefusedBuild(f"an array's state of version {short(state[0])}")
    dtype, fortran = state[-3], state[-2]
    if not (isinstance(dtype, Made) and dtype.kind == "dtype") or type(fortran) is not bool:
        raise RefusedBuild(f"an array's state with dtype {describe(dtype)}, {short(fortran)}")
    shape, data = ints(state[-4], "an array's state", "shape"), state[-1]
    if isinstance(data, list):
        nbytes = ELEMENT * math.prod(shape)
    else:
        nbytes = sized(data, "an array's data")
    charge(nbytes, "an array's data")
    return nbytes


_BYTE_ORDERS = frozenset({"<", ">", "|", "="})


def dtype_state(state: Any, spec: Any) -> None:
    """numpy.dtype.__setstate__ on a dtype made as `numpy.dtype(*spec)`: the state must be what
    numpy writes for that dtype, in either byte order. numpy believes the sizes and flags a
    state gives (flags -1 made a uint32 array look like one of objects: errors deep inside
    numpy in a fuzz run), so nothing but the dtype's own is let through."""
    import numpy

    name, align = spec
    own = numpy.dtype(name, align, True).__reduce__()[2]
    if (
        not isinstance(state, tuple)
        or len(state) != len(own)
        or state[1] not in _BYTE_ORDERS
        or state[:1] + state[2:8] != own[:1] + own[2:8]
        or (len(state) == 9 and not _datetime_unit(state[8]))
    ):
        raise RefusedBuild(f"a {name!s:.20} dtype's state {short(state)}: not what numpy writes")


def _datetime_unit(metadata: Any) -> bool:
    """A datetime64's unit, the ninth item of its dtype's state: (None, (unit, count, 1, 1))."""
    if not (isinstance(metadata, tuple) and len(metadata) == 2 and metadata[0] is None):
        return False
    unit = metadata[1]
    return (
        isinstance(unit, tuple) and len(unit) == 4 and isinstance(unit[0], bytes)
        and len(unit[0]) <= 8 and all(type(n) is int for n in unit[1:])
    )  # fmt: skip
