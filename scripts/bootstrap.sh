#!/usr/bin/env bash
# Sets up everything the demo and the tests need, from a machine that has only Python and pip:
# Debian packages (when missing and we are root), a virtualenv in .venv, torch pinned to the
# CPU build, and diag itself in editable mode. Re-running is cheap: a stamp file records what
# was installed, and nothing is redone while pyproject.toml and the package list are unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DIAG_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.diag-bootstrap"
want="$(cat "$root/pyproject.toml" "$root/scripts/debian-packages.txt" | sha256sum | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi

# Debian packages: only those that are missing; skipped with a note when not root.
missing=()
while read -r pkg; do
    [[ -z "$pkg" || "$pkg" == \#* ]] && continue
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done < "$root/scripts/debian-packages.txt"
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian packages: ${missing[*]}" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "bootstrap: not root; tests that need these Debian packages will skip: ${missing[*]}" >&2
    fi
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "bootstrap: creating virtualenv $venv" >&2
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# Some machines list extra index locations that do not exist; pip says so for every package.
quiet_pip() { "${pip[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
ref="$venv/ref/deepspeed-0.19.7"
# What torchft imports besides torch (it declares `torch>=2.7`, which would pull the CUDA build).
torchft_needs=("opentelemetry-exporter-otlp-proto-http>=1.37.0" "opentelemetry-sdk>=1.37.0")

# uv resolves and installs in parallel: the same packages in about 30 s where pip takes 80-120 s
# on 2 cores. It does not read pip's configuration, so the indexes, links, constraints and
# certificates pip is configured with (files and PIP_* variables) are handed to it; the best
# match across all indexes wins, as with pip. Byte code is compiled at install: a machine may
# set PYTHONDONTWRITEBYTECODE, and every process would compile torch from source again.
uv_install() {
    quiet_pip "uv>=0.5" || return 1
    local args
    mapfile -t args < <("$venv/bin/python" "$root/scripts/uv_index_args.py") || return 1
    local uv=("$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --compile-bytecode
        --index-strategy unsafe-best-match "${args[@]}")
    "${uv[@]}" "torch==2.13.0" -e "$root[dev]" || return 1
    "${uv[@]}" --no-deps "dlrover==0.6.1" || return 1
    "${uv[@]}" --no-deps "torchft==0.2.0" || return 1
    "${uv[@]}" "${torchft_needs[@]}" || return 1
    if [[ ! -d "$ref/deepspeed/elasticity" ]]; then
        "${uv[@]}" --no-deps --target "$ref" "deepspeed==0.19.7" || return 1
    fi
}

# pip, the way that needs nothing else, where uv is not to be had.
pip_install() {
    # torch first and pinned: any other spec (or a package that depends on torch) resolves to
    # the multi-GB CUDA build.
    quiet_pip "torch==2.13.0"
    quiet_pip -e "$root[dev]"
    quiet_pip --no-deps "dlrover==0.6.1"
    quiet_pip --no-deps "torchft==0.2.0"
    quiet_pip "${torchft_needs[@]}"
    if [[ ! -d "$ref/deepspeed/elasticity" ]]; then
        quiet_pip --no-deps --upgrade --target "$ref" "deepspeed==0.19.7"
    fi
}

# torch pinned to the CPU build (2.13.0+cpu from the configured links where the machine has
# them); dlrover-run, for the launcher tests, without its dependencies: it would pull the
# deprecated `pynvml` shim, which shadows nvidia-ml-py and makes every `import torch` warn (what
# it needs at run time, psutil, grpcio, protobuf, deprecated, is already there); DeepSpeed
# 0.19.7, the last release with `elasticity`, apart from the venv's packages: the tests compare
# diag.trainer.elastic.batchsize with its compute_elastic_config
# (tests/support/jobs/elastic_reference.py); torchft 0.2.0, for the goodput bench's torchft stack
# (its Manager, lighthouse and a prebuilt extension in one wheel, ~1 s), without its dependencies
# for the same reason, and the two OpenTelemetry packages it imports.
echo "bootstrap: installing torch==2.13.0 and diag[dev]" >&2
if [[ "${DIAG_BOOTSTRAP_PIP:-0}" == 1 ]] || ! uv_install; then
    [[ "${DIAG_BOOTSTRAP_PIP:-0}" == 1 ]] || echo "bootstrap: uv failed; installing with pip (a few minutes)" >&2
    pip_install
fi
echo "$want" > "$stamp"
echo "bootstrap: ready ($venv)" >&2
