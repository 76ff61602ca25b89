#!/usr/bin/env bash
# Vendors mermaid's browser build from the npm registry into the docs site, so its diagrams draw
# without a CDN (offline readers beside a GPU cluster see pictures, not their source).
#
#   scripts/vendor-mermaid.sh 11.17.2
#
# Fetches the package with `npm pack` (npm checks the registry's integrity hash), copies
# dist/mermaid.min.js and the licence into docs/assets/vendor/mermaid/, and prints the two
# constants for docsite/mermaid.py, which a test holds the vendored file to.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:?usage: $0 VERSION (the mermaid release on npm)}"
command -v npm >/dev/null || { echo "$0: needs npm (Debian package npm)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "mermaid@$version" >/dev/null)
tar -xzf "$work/mermaid-$version.tgz" -C "$work" package/dist/mermaid.min.js package/LICENSE
dest="$root/docs/assets/vendor/mermaid"
mkdir -p "$dest"
cp "$work/package/dist/mermaid.min.js" "$dest/mermaid.min.js"
cp "$work/package/LICENSE" "$dest/LICENSE"
echo "MERMAID_VERSION = \"$version\""
echo "MERMAID_SHA256 = \"$(sha256sum "$dest/mermaid.min.js" | cut -d' ' -f1)\""
