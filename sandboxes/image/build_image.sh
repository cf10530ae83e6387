#!/usr/bin/env bash
# Build the sandbox base image offline: debootstrap + docker import.
#
# Usage (as root, with dockerd running):
#     sandboxes/image/build_image.sh [--force] [--tag NAME:TAG] [--mirror URL]
#
# - Needs `debootstrap` and `docker` (Debian: `apt-get install -y debootstrap docker.io`) and a reachable
#   Debian mirror; no container registry is needed. Took ~65 s on a 2-core machine.
# - The mirror defaults to the first deb.debian.org-style URI found in /etc/apt/sources.list(.d).
# - Idempotent: exits 0 without work when the tag already exists, unless --force.
# - The rootfs gets a non-root user `sandbox` (uid/gid 1000, home /work); the image's default USER is 1000:1000.
# - Where a registry is reachable, `docker build -t durable-rollouts-sandbox:latest sandboxes/image` with the
#   Dockerfile beside this script gives an equivalent image.
set -euo pipefail

TAG="durable-rollouts-sandbox:latest"
FORCE=0
MIRROR=""
SUITE="bookworm"
PACKAGES="python3,python3-pytest,procps,coreutils"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1; shift ;;
        --tag) TAG="$2"; shift 2 ;;
        --mirror) MIRROR="$2"; shift 2 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

if [[ $FORCE -eq 0 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "image $TAG already exists; use --force to rebuild"
    exit 0
fi

# shellcheck source=/dev/null
source "$(dirname "$0")/debian_mirror.sh"
[[ -n "$MIRROR" ]] || MIRROR=$(find_mirror)

start=$(date +%s)
ROOTFS=$(mktemp -d /tmp/dr-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR"

# Non-root user 1000 with its home at the workdir (a tmpfs is mounted there at run time).
echo "sandbox:x:1000:1000:sandbox:/work:/bin/bash" >> "$ROOTFS/etc/passwd"
echo "sandbox:x:1000:" >> "$ROOTFS/etc/group"
echo "sandbox:*:19000:0:99999:7:::" >> "$ROOTFS/etc/shadow"
mkdir -p "$ROOTFS/work"
chown 1000:1000 "$ROOTFS/work"
# Shrink the image: apt caches and docs are of no use inside a sandbox.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/*

tar -C "$ROOTFS" --numeric-owner -c . | docker import \
    -c 'USER 1000:1000' \
    -c 'WORKDIR /work' \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 HOME=/work' \
    -c 'CMD ["sleep", "infinity"]' \
    -m "durable-rollouts sandbox base ($SUITE minbase + $PACKAGES)" \
    - "$TAG"

rm -rf "$ROOTFS"
trap - EXIT
echo "built $TAG in $(( $(date +%s) - start )) s (debootstrap, import and cleanup)"
