#!/usr/bin/env bash
# Builds the agent image where no registry is reachable but Debian's and PyPI's: the base is a
# Debian root filesystem made by debootstrap (python3, python3-venv), imported as a local image,
# then deploy/image/Dockerfile is built on it with buildah, and the result is checked: `diag
# --help` runs, as a non-root user, without torch, and py-spy carries cap_sys_ptrace.
# Needs root, buildah, podman and debootstrap (apt-get install buildah podman debootstrap).
#
#   deploy/image/build-local.sh [TAG]        (default localhost/diag-agent:0.1.0)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tag="${1:-localhost/diag-agent:0.1.0}"
base="localhost/debian-python:bookworm"
for tool in buildah podman debootstrap; do
    command -v "$tool" >/dev/null || { echo "build-local: $tool is missing (apt-get install $tool)" >&2; exit 2; }
done
if ! podman image exists "$base"; then
    rootfs="$(mktemp -d /var/tmp/diag-rootfs-XXXX)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import - "$base" >/dev/null
    rm -rf "$rootfs"
fi
# The host's CA bundle, for machines whose TLS to PyPI goes through a local authority.
buildah bud --format docker --network host --isolation chroot \
    -v /etc/ssl/certs:/etc/ssl/certs:ro --build-arg BASE="$base" \
    -f "$root/deploy/image/Dockerfile" -t "$tag" "$root"
ctr="$(buildah from "$tag")"
trap 'buildah rm "$ctr" >/dev/null' EXIT
buildah run --isolation chroot "$ctr" -- diag --help
buildah run --isolation chroot "$ctr" -- sh -c '
    test "$(id -u)" != 0 || { echo "runs as root" >&2; exit 1; }
    if python3 -c "import torch" 2>/dev/null; then echo "torch in the image" >&2; exit 1; fi
    python3 -c "from diag.agent.pyspy import CAP_SYS_PTRACE, file_has_capability, pyspy_binary
assert file_has_capability(pyspy_binary(), CAP_SYS_PTRACE), \"py-spy lacks cap_sys_ptrace\""
    echo "image ok: uid $(id -u), no torch, py-spy with cap_sys_ptrace"'
podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$tag"
