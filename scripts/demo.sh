#!/usr/bin/env bash
# The demo command: sets up what is missing, then runs `diag demo` with the given options.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/diag" demo "$@"
