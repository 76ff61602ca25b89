"""JSON decoding for dump and journal files: orjson where installed (2-3x faster than json on
thousands of files), imported when the first JSON file is read, so that an incident of
xpu_timer `.stacktrace` files never pays for its import (~3 ms of a ~90 ms merge of 32 ranks).
orjson's decode error is a ValueError, as json's is: callers catch ValueError."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any


@cache
def _orjson() -> Any:
    try:
        import orjson
    except ImportError:  # pragma: no cover - orjson is a dependency, but an optional speed-up
        return None
    return orjson


def loads(data: bytes | str) -> Any:
    """Decodes one JSON document; ValueError when it is not one."""
    orjson = _orjson()
    return orjson.loads(data) if orjson is not None else json.loads(data)


def stack_keyer() -> Callable[[Any], bytes] | None:
    """A function that serializes a stack's raw frames into one bytes key (several times cheaper
    to hash than a tuple of tuples), or None without orjson."""
    orjson = _orjson()
    return orjson.dumps if orjson is not None else None
