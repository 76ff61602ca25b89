#!/usr/bin/env bash
# Builds the diag images from nothing on a Debian machine that reaches no container registry, only
# Debian's mirror and PyPI: a base image from a Debian root filesystem made by debootstrap, then
# deploy/image/Dockerfile with buildah, then checks in the image (podman).
#
#   deploy/image/build-local.sh            the agent image, checked
#   deploy/image/build-local.sh --demo     also the demo image (torch CPU + DeepSpeed), and runs
#                                          `diag demo` in it
#   deploy/image/build-local.sh --remove   removes the images this script made
#
# Needs root and buildah, podman, debootstrap (apt-get install buildah podman debootstrap); runc
# too where crun refuses the host's cgroups (the script says so).
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), DIAG_IMAGE_CACHE (the .deb
# cache, default /var/cache/diag-image), DIAG_WHEELS (a directory of wheels pip looks in first,
# default $PIP_FIND_LINKS when that is a directory), TORCH_INDEX (where the demo's torch comes
# from, default PyTorch's CPU index).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")"
suite=bookworm
base="localhost/diag-base:$suite"
agent="localhost/diag-agent:$version"
demo="localhost/diag-demo:$version"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache="${DIAG_IMAGE_CACHE:-/var/cache/diag-image}"
torch_index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
wheels="${DIAG_WHEELS:-}"
if [[ -z "$wheels" && -d "${PIP_FIND_LINKS:-}" ]]; then wheels="$PIP_FIND_LINKS"; fi

say() { echo "build-local: $*" >&2; }
die() { say "error: $*"; exit 2; }
since() { echo "$(($(date +%s) - $1)) s"; }
size() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

preflight() {
    [[ $(id -u) -eq 0 ]] \
        || die "needs root (debootstrap, and buildah/podman with their default storage); run it with sudo"
    local missing=() tool
    for tool in buildah podman debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    ((${#missing[@]} == 0)) || die "${missing[*]} not installed: apt-get install ${missing[*]}"
}

want_demo=0
case "${1:-}" in
    "") ;;
    --demo) want_demo=1 ;;
    --remove)
        preflight
        for image in "$demo" "$agent"; do
            if podman image exists "$image"; then podman rmi "$image" >/dev/null && say "removed $image"; fi
        done
        # The layer cache: untagged images of the Dockerfile's stages (all carry the label).
        n=$(podman image prune -f --filter label=dev.diag.stage | wc -l)
        say "removed $n cached layer images"
        if podman image exists "$base"; then podman rmi "$base" >/dev/null && say "removed $base"; fi
        exit 0 ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (use --demo, --remove or --help)" ;;
esac
(($# <= 1)) || die "one argument at most (--demo, --remove or --help)"
preflight

# Everything the build mounts: nothing of it stays in the image.
tmp="$(mktemp -d /var/tmp/diag-image-XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
mounts=()
# A host CA bundle, for machines whose TLS to PyPI goes through a local authority; pip inside the
# build uses its own bundle unless told.
ca=/etc/ssl/certs/ca-certificates.crt
: > "$tmp/pip.conf"
echo "[global]" >> "$tmp/pip.conf"
if [[ -f "$ca" ]]; then
    mounts+=(-v "/etc/ssl/certs:/etc/ssl/certs:ro")
    echo "cert = $ca" >> "$tmp/pip.conf"
fi
if [[ -n "$wheels" ]]; then
    [[ -d "$wheels" ]] || die "DIAG_WHEELS=$wheels is not a directory"
    mounts+=(-v "$wheels:$wheels:ro")
    echo "find-links = $wheels" >> "$tmp/pip.conf"
fi
mounts+=(-v "$tmp/pip.conf:/etc/pip.conf:ro")

start=$(date +%s)
if podman image exists "$base"; then
    say "[1/4] base image $base exists (podman rmi $base to make it again)"
else
    say "[1/4] base image: debootstrap $suite (minbase, python3, python3-venv, ca-certificates) from $mirror"
    mkdir -p "$cache"
    rootfs="$tmp/rootfs"
    t=$(date +%s)
    if ! debootstrap --variant=minbase --cache-dir="$cache" \
        --include=python3,python3-venv,ca-certificates "$suite" "$rootfs" "$mirror" \
        > "$tmp/debootstrap.log" 2>&1; then
        tail -20 "$tmp/debootstrap.log" >&2
        die "debootstrap failed (is $mirror reachable?)"
    fi
    say "      debootstrap done in $(since "$t"); trimming docs, manuals, locales and apt's caches"
    # As Debian's slim images do: dpkg skips these paths in later installs too.
    cat > "$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
    find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
    find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "$rootfs"/usr/share/{man,info}/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
    # The container runtime brings its own /dev; the root directory must be readable by all.
    rm -rf "${rootfs:?}"/dev/*
    chmod 755 "$rootfs"
    tar --numeric-owner --xattrs --xattrs-include='*' -C "$rootfs" -c . \
        | podman import --change 'CMD ["/bin/bash"]' - "$base" > "$tmp/import.log" 2>&1 \
        || die "podman import failed: $(cat "$tmp/import.log")"
    rm -rf "$rootfs"
    say "      $base: $(size "$base")"
fi

# Podman asks for 1048576 open files and up to 32768 processes in a container; without
# CAP_SYS_RESOURCE (some VMs, nested containers) raising a limit fails, so ask for what this
# shell has, within those. crun refuses a cgroup v1 host whose cgroup v2 mount holds controllers
# ("hybrid mode"); runc runs there.
nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
[[ "$nofile" == unlimited || "$nofile" -gt 1048576 ]] && nofile=1048576
[[ "$nproc" == unlimited || "$nproc" -gt 32768 ]] && nproc=32768
limits=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
runtime=()
if ! podman run --rm --network none "${limits[@]}" "$base" true 2> "$tmp/probe.txt"; then
    if grep -q "hybrid mode" "$tmp/probe.txt"; then
        command -v runc >/dev/null \
            || die "podman's runtime (crun) refuses this host's cgroups (hybrid mode): apt-get install runc"
        runtime=(--runtime runc)
        podman "${runtime[@]}" run --rm --network none "${limits[@]}" "$base" true 2> "$tmp/probe.txt" \
            || die "podman cannot run a container here, with runc either: $(cat "$tmp/probe.txt")"
        say "      crun refuses this host's cgroups (hybrid mode): runc runs the containers"
    else
        die "podman cannot run a container here: $(cat "$tmp/probe.txt")"
    fi
fi

build() {  # target tag [build-arg...]
    local target=$1 tag=$2 t
    shift 2
    t=$(date +%s)
    # Host network: the build reaches Debian and PyPI as the host does; no bridge, no firewall rules.
    # Its steps as progress; the whole log's end if it fails.
    if ! buildah bud "${runtime[@]}" "${limits[@]}" --layers --force-rm --format docker --network host \
        "${mounts[@]}" --build-arg BASE="$base" \
        "$@" --target "$target" -f "$root/deploy/image/Dockerfile" -t "$tag" "$root" 2>&1 \
        | tee "$tmp/build-$target.log" \
        | { grep --line-buffered -E '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/[0-9]+: (RUN|COPY|FROM)' || true; } \
        | cut -c1-110 | sed 's/^/build-local:         /' >&2; then
        tail -30 "$tmp/build-$target.log" >&2
        die "building the $target image failed (the log's end is above)"
    fi
    say "      $tag built in $(since "$t"): $(size "$tag")"
}

say "[2/4] agent image $agent (deploy/image/Dockerfile, target agent)"
build agent "$agent"

say "[3/4] checks in $agent"
run() { podman "${runtime[@]}" run --rm --network none "${limits[@]}" "$@"; }
run "$agent" --help > "$tmp/help.txt" || die "diag --help failed in $agent"
grep -q "usage: diag" "$tmp/help.txt" || die "diag --help printed no usage"
run "$agent" agent --help > "$tmp/agent-help.txt" || die "diag agent --help failed in $agent"
say "      diag --help and diag agent --help run"
uid="$(run --entrypoint id "$agent" -u)"
[[ "$uid" != 0 ]] || die "$agent runs as root"
if run --entrypoint python3 "$agent" -c "import torch" 2>/dev/null; then
    die "torch is importable in $agent"
fi
run --entrypoint python3 "$agent" -c "
from diag.agent.evidence.pyspy import CAP_SYS_PTRACE, file_has_capability, pyspy_binary
assert file_has_capability(pyspy_binary(), CAP_SYS_PTRACE), 'py-spy lacks cap_sys_ptrace'
" || die "py-spy in $agent lacks its file capability cap_sys_ptrace"
# A stack dump of a sleeping Python process in the same container, as the non-root user: py-spy
# needs SYS_PTRACE in the container's bounding set (its file capability is then granted) and the
# seccomp profile that comes with the capability (process_vm_readv).
dump='python3 -c "import time; time.sleep(60)" & sleep 1; py-spy dump --pid $! 2>&1; rc=$?; kill $!; exit $rc'
if run --cap-add SYS_PTRACE --entrypoint bash "$agent" -c "$dump" > "$tmp/dump.txt"; then
    grep -q "sleep" "$tmp/dump.txt" || die "py-spy dump with SYS_PTRACE showed no stack: $(cat "$tmp/dump.txt")"
else
    die "py-spy dump as uid $uid with --cap-add SYS_PTRACE failed: $(cat "$tmp/dump.txt")"
fi
if run --entrypoint bash "$agent" -c "$dump" > "$tmp/dump-nocap.txt"; then
    without="also works without it"
else
    without="without it: $(head -c 200 "$tmp/dump-nocap.txt" | head -1)"
fi
pyspy="$(run --cap-add SYS_PTRACE --entrypoint py-spy "$agent" --version)"
say "      uid $uid, no torch, $pyspy with cap_sys_ptrace: a dump works with --cap-add SYS_PTRACE, $without"
say "      $agent: $(size "$agent")"

if ((want_demo == 0)); then
    say "[4/4] demo image skipped (--demo builds it and runs diag demo); done in $(since "$start")"
    exit 0
fi

say "[4/4] demo image $demo (target demo: the agent plus torch==2.13.0 CPU and deepspeed)"
index_host="$(echo "$torch_index" | sed -E 's#^[a-z]+://([^/:]+).*#\1#')"
if ! getent hosts "$index_host" >/dev/null; then
    # Without PyTorch's CPU index, torch==2.13.0 on PyPI is the CUDA build (gigabytes), unless a
    # CPU wheel lies in the wheels directory, where pip prefers it (2.13.0+cpu sorts higher).
    compgen -G "${wheels:-/nonexistent}/torch-2.13.0+cpu-*.whl" >/dev/null \
        || die "$torch_index is not reachable and no torch-2.13.0+cpu wheel is in DIAG_WHEELS ('$wheels'): set TORCH_INDEX to a reachable CPU index or DIAG_WHEELS to a directory with that wheel"
    say "      $index_host is not reachable: torch from PyPI with the CPU wheel in $wheels"
    torch_index=https://pypi.org/simple
fi
build demo "$demo" --build-arg TORCH_INDEX="$torch_index"
say "      running diag demo in $demo (--network none --cap-add SYS_PTRACE)"
t=$(date +%s)
if run --cap-add SYS_PTRACE "$demo" demo > "$tmp/demo.txt" 2>&1; then
    cat "$tmp/demo.txt" >&2
    say "      diag demo exited 0 in $(since "$t")"
else
    rc=$?
    cat "$tmp/demo.txt" >&2
    die "diag demo exited $rc in $demo"
fi
say "done in $(since "$start")"
