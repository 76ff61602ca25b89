"""Fields of a JSON document another process wrote, each checked for type and range.

Another node's report, a verdict on the shared volume, a precheck report: `json.loads` gives
whatever was written. `Fields` wraps one object of such a document and hands out its fields as
our types (an int within bounds, a finite float, a string of bounded length without control
characters, a list of bounded length), or raises `UntrustedInput` naming the file and the field,
so the caller refuses the whole document in one line instead of a traceback later.
"""

from __future__ import annotations

import builtins
import enum
import math
from collections.abc import Iterator
from typing import Any, TypeVar

from diag.formats.refusals import UntrustedInput, printable

E = TypeVar("E", bound=enum.Enum)

_MISSING: Any = object()
TEXT = 4096  # a message, a reason, a summary
NAME = 256  # a node, a host, an id


class Fields:
    """One JSON object of a document from `source`, at `where` in it ("" for the top)."""

    __slots__ = ("d", "source", "where")

    def __init__(self, obj: object, source: builtins.str, where: builtins.str = "") -> None:
        if not isinstance(obj, dict):
            raise UntrustedInput(source, f"{where or 'the document'} is not a JSON object")
        self.d: dict[builtins.str, Any] = obj
        self.source = source
        self.where = where

    def _name(self, key: builtins.str) -> builtins.str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: builtins.str, problem: builtins.str) -> UntrustedInput:
        return UntrustedInput(self.source, f"{self._name(key)} {problem}")

    def _get(self, key: builtins.str, default: Any) -> Any:
        if key in self.d:
            return self.d[key]
        if default is _MISSING:
            raise self.fail(key, "is missing")
        return default

    def has(self, key: builtins.str) -> builtins.bool:
        return self.d.get(key) is not None

    def int(
        self, key: builtins.str, lo: builtins.int, hi: builtins.int, default: Any = _MISSING
    ) -> builtins.int:
        v = self.d.get(key, default)
        if type(v) is int and lo <= v <= hi:  # the common case, first
            return v
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, f"must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise self.fail(key, f"{v} is out of range [{lo}, {hi}]")
        return v

    def opt_int(self, key: builtins.str, lo: builtins.int, hi: builtins.int) -> builtins.int | None:
        return None if self.d.get(key) is None else self.int(key, lo, hi)

    def float(
        self,
        key: builtins.str,
        default: Any = _MISSING,
        lo: builtins.float = -math.inf,
        hi: builtins.float = math.inf,
    ) -> builtins.float:
        v = self.d.get(key, default)
        if type(v) is float and lo <= v <= hi and math.isfinite(v):
            return v
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(key, f"must be a number, got {type(v).__name__}")
        try:
            f = float(v)
        except OverflowError:
            raise self.fail(key, "is too large") from None
        if not math.isfinite(f) or not lo <= f <= hi:
            raise self.fail(key, f"{f} is out of range")
        return f

    def opt_float(
        self, key: builtins.str, lo: builtins.float = -math.inf, hi: builtins.float = math.inf
    ) -> builtins.float | None:
        v = self.d.get(key)
        if v is None:
            return None
        if type(v) is float and lo <= v <= hi and math.isfinite(v):
            return v
        return self.float(key, lo=lo, hi=hi)

    def bool(self, key: builtins.str, default: Any = _MISSING) -> builtins.bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self.fail(key, f"must be true or false, got {type(v).__name__}")
        return v

    def opt_bool(self, key: builtins.str) -> builtins.bool | None:
        return None if self.d.get(key) is None else self.bool(key)

    def str(
        self, key: builtins.str, default: Any = _MISSING, max_len: builtins.int = NAME
    ) -> builtins.str:
        v = self._get(key, default)
        if not isinstance(v, str):
            raise self.fail(key, f"must be a string, got {type(v).__name__}")
        if len(v) > max_len:
            raise self.fail(key, f"is {len(v)} characters, over the limit of {max_len}")
        return printable(v)

    def opt_str(self, key: builtins.str, max_len: builtins.int = NAME) -> builtins.str | None:
        return None if self.d.get(key) is None else self.str(key, max_len=max_len)

    def enum(self, key: builtins.str, kind: type[E], default: Any = _MISSING) -> E:
        v = self._get(key, default)
        if isinstance(v, kind):
            return v
        try:
            return kind(v)
        except (ValueError, TypeError):
            raise self.fail(key, f"is not one of {', '.join(str(e.value) for e in kind)}") from None

    def list(self, key: builtins.str, max_items: builtins.int, default: Any = ()) -> list[Any]:
        v = self._get(key, default)
        if isinstance(v, tuple):  # a default
            v = list(v)
        if not isinstance(v, list):
            raise self.fail(key, f"must be a list, got {type(v).__name__}")
        if len(v) > max_items:
            raise self.fail(key, f"has {len(v)} items, over the limit of {max_items}")
        return v

    def ints(
        self, key: builtins.str, lo: builtins.int, hi: builtins.int, max_items: builtins.int
    ) -> tuple[builtins.int, ...]:
        items = self.list(key, max_items)
        for i, v in enumerate(items):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise self.fail(f"{key}[{i}]", f"must be an integer in [{lo}, {hi}]")
        return tuple(items)

    def strs(
        self, key: builtins.str, max_items: builtins.int, max_len: builtins.int = TEXT
    ) -> tuple[builtins.str, ...]:
        items = self.list(key, max_items)
        out = []
        for i, v in enumerate(items):
            if not isinstance(v, str) or len(v) > max_len:
                raise self.fail(f"{key}[{i}]", f"must be a string of at most {max_len} characters")
            out.append(printable(v))
        return tuple(out)

    def obj(self, key: builtins.str) -> Fields:
        return Fields(self._get(key, _MISSING), self.source, self._name(key))

    def opt_obj(self, key: builtins.str) -> Fields | None:
        return None if self.d.get(key) is None else self.obj(key)

    def objs(self, key: builtins.str, max_items: builtins.int) -> Iterator[Fields]:
        for i, v in enumerate(self.list(key, max_items)):
            yield Fields(v, self.source, f"{self._name(key)}[{i}]")
