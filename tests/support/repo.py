"""Where things are in the repository, for tests, benches and job scripts in any folder."""

import os
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # the tests' helpers, by concern, one folder each
ROOT = SUPPORT.parents[1]
BENCH = ROOT / "bench"
JOBS = SUPPORT / "jobs"  # training job scripts and what they import (run as `python JOBS/x.py`)
EVIDENCE = SUPPORT / "evidence"  # recorded incidents, dumps and their builders

# Every helper folder; pyproject's pytest `pythonpath` lists the same (a test holds them
# together), and a process started from a test gets them on PYTHONPATH through `pythonpath()`.
FOLDERS = tuple(
    sorted(p for p in SUPPORT.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
)


def on_sys_path() -> None:
    """Puts every helper folder on this process's path (for benches run as scripts)."""
    import sys

    sys.path[:0] = [p for p in map(str, FOLDERS) if p not in sys.path]


def pythonpath(*extra: str) -> str:
    """A PYTHONPATH that finds every helper module, then `extra`."""
    return os.pathsep.join([str(SUPPORT), *map(str, FOLDERS), *[e for e in extra if e]])
