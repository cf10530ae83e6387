#!/usr/bin/env bash
# Build the reference harness image offline: mini-swe-agent (pinned) and its own runtime (CPython 3.11 with
# the shared libraries it links, glibc's loader included) in /opt/harness (image/Dockerfile).
#
# Usage (dockerd running; harbor-examples/base:bookworm from environments/harbor/base_images.sh):
#     environments/harness/build_image.sh [--docker-host URL] [--wheels DIR]
#
# The wheels pinned in image/wheels.lock are fetched on this host by `pip download --no-deps` (Python 3.11,
# manylinux x86_64) into DIR (default .cache/harness-wheels, reused while it holds that lock's wheels) and
# copied into the build context; the image is built with --network none. Task images of the `mini-swe-agent`
# environment copy /opt/harness from it. Idempotent: an existing tag built from the same files (its label
# dr.harness.content, a hash of image/, the lock included) is left alone; one built from other files is an
# error: bump REVISION (and harness_env.RUNTIME_REVISION).
#
#     environments/harness/build_image.sh --relock    # image/wheels.lock anew from the index (bump REVISION)
set -euo pipefail
VERSION="2.4.6"
REVISION="rt2"
TAG="dr-harness/mini-swe-agent:${VERSION}-${REVISION}"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WHEELS="$ROOT/.cache/harness-wheels"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
LOCK="$HERE/image/wheels.lock"
PLATFORM=(--only-binary=:all: --python-version 3.11 --implementation cp --platform manylinux2014_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
RELOCK=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --docker-host) export DOCKER_HOST="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --relock) RELOCK=1; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
if [[ $RELOCK -eq 1 ]]; then
    FRESH="$(mktemp -d)"
    "$PIP" download -q -d "$FRESH" "mini-swe-agent==$VERSION" pip "${PLATFORM[@]}"
    { sed -n '/^#/p' "$LOCK"
      for wheel in "$FRESH"/*.whl; do
          base="$(basename "$wheel")"; name="${base%%-*}"; rest="${base#*-}"
          echo "$(echo "$name" | tr '_A-Z' '-a-z')==${rest%%-*}"
      done | LC_ALL=C sort; } > "$LOCK.new"
    mv "$LOCK.new" "$LOCK"
    rm -rf "$FRESH"
    echo "wrote $LOCK: bump REVISION"
    exit 0
fi
LOCKSUM="$(sha256sum "$LOCK" | cut -c1-64)"
if [[ "$(cat "$WHEELS/.lock.sha256" 2>/dev/null)" != "$LOCKSUM" ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PIP" download -q --no-deps -d "$WHEELS" -r "$LOCK" "${PLATFORM[@]}"
    echo "$LOCKSUM" > "$WHEELS/.lock.sha256"
fi
CONTENT="$(cd "$HERE/image" && { sha256sum Dockerfile python3 bundle.sh check.py wheels.lock; } | sha256sum | cut -c1-16)"
if HAVE="$(docker image inspect -f '{{ index .Config.Labels "dr.harness.content" }}' "$TAG" 2>/dev/null)"; then
    if [[ "$HAVE" == "$CONTENT" ]]; then
        echo "image $TAG exists"
        exit 0
    fi
    echo "image $TAG exists but was built from other files ($HAVE, these are $CONTENT): bump REVISION" >&2
    exit 1
fi
CTX="$(mktemp -d)"
trap 'rm -rf "$CTX"' EXIT
cp "$HERE"/image/{Dockerfile,python3,bundle.sh,check.py} "$CTX/"
cp -r "$WHEELS" "$CTX/wheels"
DOCKER_BUILDKIT=0 docker build -q --network none --label "dr.harness.content=$CONTENT" -t "$TAG" "$CTX" >/dev/null
echo "built $TAG"
