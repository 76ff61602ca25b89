#!/usr/bin/env bash
# Regenerates the gRPC stubs in diag/proto/ from the .proto files there (tests/formats/test_proto_stubs.py
# fails when the committed stubs are stale).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/python" -m diag.proto.generate "$@"
