#!/usr/bin/env bash
# The test command: sets up what is missing, then checks lint, format and types and runs the suite.
#
#   ./scripts/test.sh            everything, the tests spread over parallel workers
#   ./scripts/test.sh --fast     lint, types and the pure and unit tests (about a minute)
#   ./scripts/test.sh --long     everything and the long tier (soaks, full repetitions)
#   ./scripts/test.sh [--fast|--long] ARGS...   ARGS go to pytest (files, -k, -x, -n 0 ...)
#
# DIAG_TEST_WORKERS sets the number of workers (default: twice the CPUs, at least 4: most of the
# suite waits on timeouts of real processes, not on a CPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fast=0
long=()
case "${1:-}" in
--fast) fast=1 && shift ;;
--long) long=(--long) && shift ;;
esac
"$root/scripts/bootstrap.sh"
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The type check runs beside the tests; its verdict is waited for at the end.
mkdir -p .mypy_cache
scripts/typecheck.sh > .mypy_cache/typecheck.log 2>&1 &
types=$!
pytest=(.venv/bin/python -m pytest)
if ((fast)); then
    pytest+=(--fast -n 2 -q)
else
    cpus="$(nproc)"
    workers="${DIAG_TEST_WORKERS:-$((cpus * 2 > 4 ? cpus * 2 : 4))}"
    # One test at a time to whichever worker is free, the longest first; a module's tests that
    # share a set-up go together (tests/conftest.py).
    pytest+=(-n "$workers" --dist loadgroup "${long[@]}")
fi
status=0
"${pytest[@]}" "$@" || status=$?
if ! wait "$types"; then
    cat .mypy_cache/typecheck.log >&2
    echo "test.sh: the type check failed (scripts/typecheck.sh)" >&2
    status=1
fi
exit "$status"
