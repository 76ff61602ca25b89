#!/usr/bin/env bash
# The demo command: sets up what is missing, then runs `diag demo` with the given options.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      # The flags need only the standard library: no 1.8 GB set-up to read them.
      cd "$root"
      exec "$(command -v python3 || echo python)" -m diag.cli.main demo --help
      ;;
  esac
done
"$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/diag" demo "$@"
