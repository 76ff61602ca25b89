"""Loads the production-shaped incident generator (`bench/incidentgen/`) for the tests."""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parents[3] / "bench")
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

import incidentgen as gen  # noqa: E402

__all__ = ["gen"]
