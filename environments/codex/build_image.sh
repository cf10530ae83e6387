#!/usr/bin/env bash
# Build the Codex harness image offline: Codex CLI (pinned) in /opt/codex.
#
# Usage (dockerd running): environments/codex/build_image.sh [--docker-host URL] [--dest DIR]
#
# The binary is fetched on this host by fetch_codex.sh (npm, into DIR, default .cache/codex, reused when
# present) and copied into the build context; the image is built with --network none. Task images of the
# `codex` environment copy /opt/codex from it. Idempotent: an existing tag is left alone.
set -euo pipefail
VERSION="0.169.0"
TAG="dr-harness/codex:${VERSION}"
HERE="$(cd "$(dirname "$0")" && pwd)"
FETCH=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --docker-host) export DOCKER_HOST="$2"; shift 2 ;;
        --dest) FETCH=(--dest "$2"); shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "image $TAG exists"
    exit 0
fi
BIN="$(bash "$HERE/fetch_codex.sh" "${FETCH[@]}" | tail -1)"
CTX="$(mktemp -d)"
trap 'rm -rf "$CTX"' EXIT
cp "$HERE/image/Dockerfile" "$CTX/"
cp "$BIN" "$CTX/codex"
DOCKER_BUILDKIT=0 docker build -q --network none -t "$TAG" "$CTX" >/dev/null
echo "built $TAG"
