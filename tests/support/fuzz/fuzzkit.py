"""Fuzzing diag's parsers of outside data: one target per parser, one harness.

A target gives valid seed inputs and a function that parses a file the way diag reads it from a
shared directory. The harness writes mutated inputs (byte-level and, for JSON, structure-aware:
a leaf replaced by a huge, negative, NaN, wrongly typed or path-escaping value) and checks that
each one is either accepted or refused with the target's own error: never another exception,
never a hang, never unbounded memory.

Two drivers share `check_one`: the suite's short runs draw mutations through hypothesis (so a
failure shrinks to a small input), and `bench/fuzz.py` runs 100,000+ inputs per target from a
seeded `random.Random`.

Targets live in modules named `fuzztargets_<area>.py` beside this file, each with a list
`TARGETS`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import math
import pkgutil
import random
import resource
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from diag.formats.untrusted import UntrustedInput

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class FuzzTarget:
    name: str
    # Valid inputs, made once per run in a scratch directory (the target may write helper files
    # there: a fuzzed input is written beside them under `file_name`).
    seeds: Callable[[Path], list[bytes]]
    # Parses the file at the path as diag would; returns anything or raises one of `refusals`.
    parse: Callable[[Path], object]
    refusals: tuple[type[BaseException], ...] = (UntrustedInput,)
    file_name: str = "input"
    json: bool = False  # seeds are JSON: add structure-aware mutations
    time_limit_s: float = 2.0


class Hang(Exception):
    pass


@dataclass
class Finding:
    kind: str  # "crash" or "hang"
    data: bytes
    detail: str


@dataclass
class FuzzResult:
    target: str
    inputs: int = 0
    accepted: int = 0
    refused: int = 0
    findings: list[Finding] = field(default_factory=list)
    slowest_s: float = 0.0
    seconds: float = 0.0
    rss_growth_mb: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.findings


# --- mutations ------------------------------------------------------------------------------

_TOKENS = [
    b"-1",
    b"0",
    b"1e309",
    b"-1e309",
    b"NaN",
    b"Infinity",
    b"99999999999999999999999",
    b"2000000000",
    b"null",
    b"true",
    b"[]",
    b"{}",
    b'""',
    b'"../../etc/passwd"',
    b'"/etc/shadow"',
    b'"\\u001b[31mred"',
    b'"\\u0000"',
    b"\xff\xfe",
    b"\x00",
    b"[" * 64,
    b"{" * 64,
    b'"a"' * 64,
]

_EVIL_VALUES: list[object] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    10**30,
    -(10**30),
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "abc",
    "../../../etc/passwd",
    "/etc/passwd",
    "a/../../b",
    "\x1b]0;owned\x07",
    "x" * 5000,
    [],
    {},
    [5],
    ["a", None],
    {"a": 1},
    [[[[[]]]]],
    0o4777,
    2000000000,
]


def _mutate_bytes(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip a bit
            i = min(pos, len(b) - 1)
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # interesting byte
            b[min(pos, len(b) - 1)] = rng.choice((0, 0x7F, 0x80, 0xFF, 0x22, 0x5C, 0x2F))
        elif op == 2:  # insert random bytes
            b[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and b:  # delete a range
            del b[pos : pos + rng.randint(1, 32)]
        elif op == 4 and b:  # duplicate a range
            end = min(len(b), pos + rng.randint(1, 64))
            b[pos:pos] = b[pos:end]
        elif op == 5:  # truncate
            del b[pos:]
        elif op == 6 and seeds:  # splice another seed
            other = rng.choice(seeds)
            cut = rng.randrange(len(other) + 1)
            b = b[:pos] + bytearray(other[cut:])
        else:  # a token that parsers meet badly
            b[pos:pos] = rng.choice(_TOKENS)
    return bytes(b)


def _leaves(obj: object, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))


def _replace(obj: object, path: tuple, value: object, delete: bool) -> object:
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]  # type: ignore[index]
    if delete:
        del parent[path[-1]]  # type: ignore[attr-defined]
    else:
        parent[path[-1]] = value  # type: ignore[index]
    return obj


def _mutate_json(rng: random.Random, data: bytes) -> bytes | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    for _ in range(rng.randint(1, 3)):
        paths = list(_leaves(obj))
        path = rng.choice(paths)
        op = rng.randrange(10)
        if op == 0 and path:
            obj = _replace(obj, path, None, delete=True)
        elif op == 1 and isinstance(obj, dict):
            key = rng.choice(("extra", "pid", "files", "rank", "path", "mode"))
            obj[key] = copy.deepcopy(rng.choice(_EVIL_VALUES))
        else:
            obj = _replace(obj, path, copy.deepcopy(rng.choice(_EVIL_VALUES)), delete=False)
    return json.dumps(obj, allow_nan=True).encode()


def mutate(rng: random.Random, seeds: list[bytes], structured: bool) -> bytes:
    seed = rng.choice(seeds)
    if structured and rng.random() < 0.6:
        out = _mutate_json(rng, seed)
        if out is not None:
            return out
    if rng.random() < 0.03:
        return rng.randbytes(rng.randint(0, 256))
    return _mutate_bytes(rng, seed, seeds)


# --- checking --------------------------------------------------------------------------------


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: object) -> None:
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_one(target: FuzzTarget, data: bytes, scratch: Path) -> tuple[str, float, str]:
    """Writes `data` as the target's input in `scratch` and parses it. Returns (outcome,
    seconds, detail) with outcome "accepted", "refused", "crash" or "hang"."""
    path = scratch / target.file_name
    path.write_bytes(data)
    t0 = time.perf_counter()
    try:
        with _deadline(target.time_limit_s):
            target.parse(path)
    except Hang as e:
        return "hang", time.perf_counter() - t0, str(e)
    except target.refusals as e:
        return "refused", time.perf_counter() - t0, str(e)
    except Exception:
        return "crash", time.perf_counter() - t0, traceback.format_exc(limit=8)
    return "accepted", time.perf_counter() - t0, ""


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_target(
    target: FuzzTarget,
    scratch: Path,
    *,
    inputs: int,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> FuzzResult:
    """The bench's driver: `inputs` mutations from a seeded generator."""
    scratch.mkdir(parents=True, exist_ok=True)
    seeds = target.seeds(scratch)
    rng = random.Random(seed)
    result = FuzzResult(target.name)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    for i in range(inputs):
        data = seeds[i] if i < len(seeds) else mutate(rng, seeds, target.json)
        outcome, secs, detail = check_one(target, data, scratch)
        result.inputs += 1
        result.slowest_s = max(result.slowest_s, secs)
        if outcome == "accepted":
            result.accepted += 1
        elif outcome == "refused":
            result.refused += 1
        elif len(result.findings) < 20:
            result.findings.append(Finding(outcome, data, detail))
        if progress and (i + 1) % 5000 == 0:
            progress(i + 1)
    result.seconds = time.perf_counter() - t0
    result.rss_growth_mb = _rss_mb() - rss0
    return result


def all_targets() -> list[FuzzTarget]:
    targets: list[FuzzTarget] = []
    for info in sorted(pkgutil.iter_modules([str(HERE)]), key=lambda m: m.name):
        if info.name.startswith("fuzztargets_"):
            targets.extend(importlib.import_module(info.name).TARGETS)
    return targets
