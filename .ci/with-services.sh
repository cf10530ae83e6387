#!/usr/bin/env bash
# Run a command with the services the tests need, then stop exactly what this script started (by pid).
#   - Docker: Debian's docker.io (and debootstrap for the sandbox image) are installed if missing; dockerd
#     is started if no daemon answers; the sandbox image is built offline if absent.
#   - Chromium: Debian's chromium is installed if missing (headless report rendering, the web UI check).
#   - Prometheus: Debian's prometheus is installed if missing (tests/integration/test_metrics.py starts its
#     own, by pid, scraping an in-process worker).
#   - docker-registry: Debian's image registry is installed if missing (tests/integration/test_image_registry.py
#     starts its own, by pid, on 127.0.0.1).
#   - haproxy and iproute2: Debian's haproxy (the TLS proxy verifying client certificates in front of Temporal)
#     and iproute2 (ip netns, tc) are installed if missing (tests/integration/test_multihost.py builds a cluster
#     of network namespaces and starts its own proxy, by pid).
#   - docker-compose: Debian's docker-compose is installed if missing; the project's image
#     durable-rollouts:local is built offline (tests/integration/test_compose.py runs the local stack).
#   - PostgreSQL: Debian's postgresql is installed if initdb is missing (Debian keeps it under
#     /usr/lib/postgresql/<major>/bin, not on PATH); the tests start their own cluster in a temporary
#     directory, by pid (tests/postgres.py), unless ROLLOUTS_TEST_POSTGRES names a server.
# Temporal and vLLM are started by the test fixtures themselves (tests/conftest.py), by pid.
set -uo pipefail
cd "$(dirname "$0")/.."
state="${ROLLOUTS_HOME:-.rollouts}/ci"
mkdir -p "$state"
started_dockerd=""

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v prometheus >/dev/null \
    || ! command -v docker-compose >/dev/null || ! command -v docker-registry >/dev/null \
    || ! command -v haproxy >/dev/null || ! command -v tc >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap prometheus docker-compose docker-registry haproxy iproute2 >/dev/null
  else
    echo "docker.io, debootstrap, prometheus, docker-compose, docker-registry, haproxy or iproute2 is missing; install them (apt-get install docker.io debootstrap prometheus docker-compose docker-registry haproxy iproute2) as root" >&2
  fi
fi

# The store's tests and the math run run on both store backends; under CI a missing PostgreSQL fails them.
if [ -z "${ROLLOUTS_TEST_POSTGRES:-}" ] && ! command -v initdb >/dev/null \
    && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null
  else
    echo "PostgreSQL is missing; install it (apt-get install postgresql) as root, or set ROLLOUTS_TEST_POSTGRES" >&2
  fi
fi

# Headless Chromium renders the run reports in tests/integration/test_report.py and the Temporal web UI's
# "stuck" filter in tests/integration/test_ops.py.
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
  else
    echo "chromium is missing; install it (apt-get install chromium) as root" >&2
  fi
fi

if command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    dockerd >"$state/dockerd.log" 2>&1 &
    started_dockerd=$!
    echo "$started_dockerd" >"$state/dockerd.pid"
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  fi
fi

if docker info >/dev/null 2>&1; then
  bash sandboxes/image/build_image.sh || echo "sandbox image build failed; Docker tests will say why" >&2
  bash environments/swe/build_images.sh || echo "SWE image build failed; SWE Docker tests will say why" >&2
  bash environments/harbor/base_images.sh || echo "Harbor examples' base image failed; Harbor tests will say why" >&2
  bash environments/harness/build_image.sh || echo "harness image build failed; harness tests will say why" >&2
  bash environments/codex/build_image.sh || echo "codex image build failed; codex tests will say why" >&2
  # The project's image (~3-12 min) only where the compose test may run: the whole suite, or a command naming
  # it (its fixture builds the image itself too, so a test run elsewhere still gets a fresh one).
  case " $* " in
    *test_compose*) bash workers/image/build_local_image.sh || echo "project image build failed; the compose test will say why" >&2 ;;
    *" tests/"*|*" environments/"*|*" integrations/"*) ;;
    *) bash workers/image/build_local_image.sh || echo "project image build failed; the compose test will say why" >&2 ;;
  esac
fi

"$@"
rc=$?

if [ -n "$started_dockerd" ]; then
  kill "$started_dockerd" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 0.5; done
  rm -f "$state/dockerd.pid"
fi
exit $rc
