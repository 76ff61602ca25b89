#!/usr/bin/env bash
# The type check: mypy over the diag package, with the settings of [tool.mypy] in
# pyproject.toml.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec .venv/bin/mypy "$@"
