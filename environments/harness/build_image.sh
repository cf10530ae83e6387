#!/usr/bin/env bash
# Build the reference harness image offline: mini-swe-agent (pinned) and its own runtime (CPython 3.11 with
# the shared libraries it links, glibc's loader included) in /opt/harness (image/Dockerfile).
#
# Usage (dockerd running; harbor-examples/base:bookworm from environments/harbor/base_images.sh):
#     environments/harness/build_image.sh [--docker-host URL] [--wheels DIR]
#
# The wheels are fetched on this host by `pip download` (Python 3.11, manylinux x86_64) into DIR (default
# .cache/harness-wheels, reused when present) and copied into the build context; the image is built with
# --network none. Task images of the `mini-swe-agent` environment copy /opt/harness from it. Idempotent: an
# existing tag built from the same files (its label dr.harness.content, a hash of image/ and the wheel list)
# is left alone; one built from other files is an error: bump REVISION (and harness_env.HARNESS_IMAGE).
set -euo pipefail
VERSION="2.4.6"
REVISION="rt1"
TAG="dr-harness/mini-swe-agent:${VERSION}-${REVISION}"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WHEELS="$ROOT/.cache/harness-wheels"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --docker-host) export DOCKER_HOST="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
if ! ls "$WHEELS"/mini_swe_agent-"$VERSION"-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEELS"
    "$PIP" download -q -d "$WHEELS" "mini-swe-agent==$VERSION" pip --only-binary=:all: --python-version 3.11 \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64
fi
CONTENT="$(cd "$HERE/image" && { sha256sum Dockerfile python3 bundle.sh check.py; ls "$WHEELS"; } | sha256sum | cut -c1-16)"
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
