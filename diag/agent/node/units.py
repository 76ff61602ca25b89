"""Rates and sizes as the user types them (`100Mbit`, `1.5GB/s`, `64MiB`) and as we print them.

Internally every bandwidth is bytes per second, every size bytes, every throughput FLOP/s.
"""

from __future__ import annotations

import re

_RATE_UNITS: dict[str, float] = {
    "": 1.0,
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
    "kibit": 1024 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
}
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")


def parse_rate(text: str) -> float:
    """Bytes per second from `800MB/s`, `1.5GB/s`, `100Mbit`, `25Gbit` or a plain number of B/s."""
    m = _NUMBER.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _RATE_UNITS:
        raise ValueError(
            f"bad rate {text!r}: use a number with one of B/s, KB/s, MB/s, GB/s, Kbit, Mbit, Gbit"
        )
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_size(text: str) -> int:
    """Bytes from `4MiB`, `64MB`, `1GiB` or a plain number of bytes."""
    m = _NUMBER.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(
            f"bad size {text!r}: use a number with one of B, KB, MB, GB, KiB, MiB, GiB"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _scaled(value: float, unit: str, steps: tuple[str, ...]) -> str:
    for prefix in steps[:-1]:
        if abs(value) < 1000:
            return f"{value:.3g} {prefix}{unit}"
        value /= 1000
    return f"{value:.3g} {steps[-1]}{unit}"


def fmt_rate(bytes_per_s: float | None) -> str:
    """`11.9 MB/s`, `790 MB/s`, `23.4 GB/s`; `-` when nothing was measured."""
    if bytes_per_s is None:
        return "-"
    return _scaled(bytes_per_s, "B/s", ("", "K", "M", "G", "T"))


def fmt_flops(flops: float | None) -> str:
    """`46.2 GFLOP/s`, `712 TFLOP/s`."""
    if flops is None:
        return "-"
    return _scaled(flops, "FLOP/s", ("", "K", "M", "G", "T", "P"))


def fmt_size(nbytes: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"
