#!/usr/bin/env bash
# The test command: sets up what is missing, checks lint, format and types, runs the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The type check: its cache under .mypy_cache keeps a run without changes at a few seconds.
scripts/typecheck.sh
exec .venv/bin/python -m pytest "$@"
