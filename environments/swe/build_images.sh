#!/usr/bin/env bash
# Build the SWE environment's task images offline: one per folder of images/ (images/NAME/Dockerfile).
#
# Usage (with dockerd running; the base image durable-rollouts-sandbox:latest built first by
# sandboxes/image/build_image.sh):
#     environments/swe/build_images.sh [--force] [NAME ...]
#
# - images/NAME becomes the tag durable-rollouts-swe-NAME:latest (the tag tasks name in their "image", and
#   SWE-bench-style rows in their "image_name" or "docker_image": images/calc and images/wordstat).
# - Offline: every Dockerfile is FROM the local base image and only COPYs; nothing is pulled (the classic
#   builder, no --pull), so no registry is needed.
# - A folder with a prepare.sh (images/sweb-django, images/sweb-sympy) gets its build context made by it on
#   the host first: a PyPI sdist as a git repository at a fixed commit, Debian's git and patch; fetched with
#   pip and apt-get into a cache (images/sdist_repo.sh) on the first build only. Its file "tags" lists more
#   tags for the image: the names SWE-bench's harness gives its instances' images.
# - Idempotent: an image whose tag exists and whose source hash (label durable-rollouts-swe.source, the
#   sha256 of the folder's files) matches is skipped; --force rebuilds it anyway. Exit status 0 when every
#   image exists afterwards.
set -euo pipefail
cd "$(dirname "$0")"

BASE="durable-rollouts-sandbox:latest"
FORCE=0
NAMES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "unknown option: $1" >&2; exit 2 ;;
        *) NAMES+=("$1"); shift ;;
    esac
done
if [[ ${#NAMES[@]} -eq 0 ]]; then
    for dir in images/*/; do NAMES+=("$(basename "$dir")"); done
fi

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    echo "base image $BASE is missing; build it first: sandboxes/image/build_image.sh" >&2
    exit 1
fi

for name in "${NAMES[@]}"; do
    dir="images/$name"
    tag="durable-rollouts-swe-$name:latest"
    if [[ ! -f "$dir/Dockerfile" ]]; then
        echo "no $dir/Dockerfile" >&2
        exit 2
    fi
    # The base image's id is part of the hash: a rebuilt base image rebuilds every task image.
    # A prepared folder's hash also covers the shared helper its prepare.sh sources.
    source=$( (docker image inspect -f '{{.Id}}' "$BASE"; [[ ! -f "$dir/prepare.sh" ]] || sha256sum images/sdist_repo.sh
        cd "$dir" && find . -type f -not -path '*/__pycache__/*' -print0 | sort -z \
        | xargs -0 sha256sum) | sha256sum | cut -c1-16)
    found=$(docker image inspect -f '{{index .Config.Labels "durable-rollouts-swe.source"}}' "$tag" 2>/dev/null || true)
    if [[ $FORCE -eq 0 && "$found" == "$source" ]]; then
        echo "image $tag is up to date ($source); use --force to rebuild"
        continue
    fi
    start=$(date +%s)
    context="$dir"
    if [[ -f "$dir/prepare.sh" ]]; then
        context=$(mktemp -d "/tmp/swe-image-$name.XXXXXX")
        cp -a "$dir/." "$context/"
        if ! bash "$dir/prepare.sh" "$context"; then
            rm -rf "$context"
            echo "preparing $tag failed" >&2
            exit 1
        fi
    fi
    # The classic builder warns that it is deprecated: its output is shown only when the build fails.
    if ! out=$(DOCKER_BUILDKIT=0 docker build -q --network none --label "durable-rollouts-swe.source=$source" -t "$tag" "$context" 2>&1); then
        echo "$out" >&2
        echo "building $tag failed" >&2
        [[ "$context" == "$dir" ]] || rm -rf "$context"
        exit 1
    fi
    [[ "$context" == "$dir" ]] || rm -rf "$context"
    echo "built $tag ($source) in $(( $(date +%s) - start )) s"
done
# Every image's extra tags (kept even when the image was up to date: a tag can be removed on its own).
for name in "${NAMES[@]}"; do
    if [[ -f "images/$name/tags" ]]; then
        while read -r extra; do
            [[ -z "$extra" ]] || docker tag "durable-rollouts-swe-$name:latest" "$extra"
        done < "images/$name/tags"
    fi
done
