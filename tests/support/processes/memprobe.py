"""How much a piece of code makes a fresh process's memory grow: for memory-bomb tests, which must
see that nothing was allocated, not only that an exception came.

    probes = memprobe.run(CODE)   # CODE defines setup() -> ctx and CASES: {name: act(ctx)}
    assert probes["bomb"].peak_grew < 64 * MIB, probes["bomb"]

Each `act` runs in one child interpreter (the tests' helpers importable), in turn, between two
measurements: the resident set (psutil) and its peak (getrusage's maxrss, which an allocation
freed before the second measurement still raises); with `TRACE = True`, also the peak of what
Python allocated (tracemalloc: an allocation never touched, which the resident set does not
show). What `act` returns, or its exception as "Type: message", is its outcome.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from repo import FOLDERS, SUPPORT

MIB = 1 << 20

_HARNESS = """
import gc, json, resource, sys, tracemalloc
sys.path[:0] = {support!r}
import psutil

{code}

def _rss():
    return psutil.Process().memory_info().rss

def _peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

ctx = setup()
traced = globals().get("TRACE", False)
out = {{}}
for name, act in CASES.items():
    gc.collect()
    if traced:
        tracemalloc.start()
    before, peak_before = _rss(), _peak()
    try:
        outcome = str(act(ctx))
    except Exception as e:
        outcome = f"{{type(e).__name__}}: {{e}}"
    grew, peak_grew = _rss() - before, _peak() - peak_before
    traced_peak = tracemalloc.get_traced_memory()[1] if traced else 0
    tracemalloc.stop()
    out[name] = {{"grew": grew, "peak_grew": peak_grew, "traced_peak": traced_peak,
                 "outcome": outcome[:4000]}}
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Probe:
    grew: int  # bytes the resident set grew by from before act() to after it
    peak_grew: int  # bytes the peak resident set grew by meanwhile
    outcome: str  # what act() returned, or its exception as "Type: message"
    traced_peak: int = 0  # with TRACE = True in the code: the most Python allocated at once

    def __str__(self) -> str:
        return (
            f"resident +{self.grew / MIB:.0f} MiB, peak +{self.peak_grew / MIB:.0f} MiB, "
            f"traced peak {self.traced_peak / MIB:.0f} MiB: {self.outcome[:500]}"
        )


def run(code: str, timeout: float = 120) -> dict[str, Probe]:
    script = _HARNESS.format(support=[str(SUPPORT), *map(str, FOLDERS)], code=code)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise AssertionError(f"the probe failed ({done.returncode}): {done.stderr[-3000:]}")
    return {
        name: Probe(int(g["grew"]), int(g["peak_grew"]), str(g["outcome"]), int(g["traced_peak"]))
        for name, g in json.loads(lines[-1]).items()
    }
