"""How much a piece of code makes a fresh process's memory grow: for memory-bomb tests, which must
see that nothing was allocated, not only that an exception came.

    probe = memprobe.run(CODE)   # CODE defines setup() -> ctx and act(ctx) -> str
    assert probe.peak_grew < 64 * MIB, probe

`act` runs in a child interpreter (the tests' helpers importable) between two measurements:
the resident set (psutil) and its peak (getrusage's maxrss, which an allocation freed before the
second measurement still raises). An exception from `act` is its outcome, as text.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from repo import SUPPORT

MIB = 1 << 20

_HARNESS = """
import gc, json, resource, sys
sys.path.insert(0, {support!r})
import psutil

{code}

def _rss():
    return psutil.Process().memory_info().rss

def _peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

ctx = setup()
gc.collect()
before, peak_before = _rss(), _peak()
try:
    outcome = str(act(ctx))
except Exception as e:
    outcome = f"{{type(e).__name__}}: {{e}}"
print(json.dumps({{"grew": _rss() - before, "peak_grew": _peak() - peak_before,
                  "outcome": outcome[:4000]}}))
"""


@dataclass(frozen=True)
class Probe:
    grew: int  # bytes the resident set grew by from before act() to after it
    peak_grew: int  # bytes the peak resident set grew by meanwhile
    outcome: str  # what act() returned, or its exception as "Type: message"

    def __str__(self) -> str:
        return (
            f"resident +{self.grew / MIB:.0f} MiB, peak +{self.peak_grew / MIB:.0f} MiB: "
            f"{self.outcome[:500]}"
        )


def run(code: str, timeout: float = 120) -> Probe:
    script = _HARNESS.format(support=str(SUPPORT), code=code)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise AssertionError(f"the probe failed ({done.returncode}): {done.stderr[-3000:]}")
    got = json.loads(lines[-1])
    return Probe(int(got["grew"]), int(got["peak_grew"]), str(got["outcome"]))
