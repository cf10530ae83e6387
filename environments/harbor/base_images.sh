#!/usr/bin/env bash
# Provide the base images the example tasks' Dockerfiles name in FROM, offline.
#
# Usage (dockerd running; durable-rollouts-sandbox:latest built by sandboxes/image/build_image.sh):
#     environments/harbor/base_images.sh [--docker-host URL]
#
# No registry is reachable, so a task's FROM must name an image the sandbox host's daemon already has.
# The examples build FROM harbor-examples/base:bookworm: the project's debootstrap image (Debian bookworm,
# python3, pytest, coreutils) with USER root, as Terminal-Bench Dockerfiles expect. For your own tasks,
# give each FROM name an image on every sandbox host the same way: `docker tag LOCAL NAME`, or
# `docker save NAME | DOCKER_HOST=... docker load` from a machine that has it.
# Idempotent: an existing tag is left alone.
set -euo pipefail
if [[ "${1:-}" == "--docker-host" ]]; then export DOCKER_HOST="$2"; fi
BASE="durable-rollouts-sandbox:latest"
NAME="harbor-examples/base:bookworm"
if docker image inspect "$NAME" >/dev/null 2>&1; then
    echo "image $NAME exists"
    exit 0
fi
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    echo "base image $BASE is missing; build it first: sandboxes/image/build_image.sh" >&2
    exit 1
fi
printf 'FROM %s\nUSER root\nLABEL org.opencontainers.image.title="harbor examples base"\n' "$BASE" \
    | DOCKER_BUILDKIT=0 docker build -q -t "$NAME" - >/dev/null
echo "built $NAME from $BASE"
