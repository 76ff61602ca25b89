"""Where things are in the repository, for tests in any folder."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # the tests' helpers, job scripts and data
ROOT = SUPPORT.parents[1]
BENCH = ROOT / "bench"
