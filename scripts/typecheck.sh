#!/usr/bin/env bash
# The type check: mypy over every package of diag, with the settings of [tool.mypy] in
# pyproject.toml. The packages live in top-level folders that setuptools maps to `diag.<room>`
# (package-dir), a mapping mypy cannot read from the editable install's import hook; so mypy
# reads them through a tree of links named as they are imported, made here under .mypy_cache
# (git-ignored, and mypy's own cache beside it keeps a second run warm).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tree=.mypy_cache/tree/diag
mkdir -p "$tree"
for room in $(.venv/bin/python - <<'PY'
import tomllib
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
print(" ".join(sorted(d for d in dirs.values() if "/" not in d)))
PY
); do
    ln -sfn "../../../$room" "$tree/$room"
done
exec .venv/bin/mypy "$@"
