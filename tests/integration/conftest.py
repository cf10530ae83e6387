"""Fixtures shared by the integration tests (the session-wide ones live in tests/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE


@pytest.fixture(scope="module")
def docker() -> DockerBackend:
    try:
        backend = DockerBackend()
        backend.client.images.get(DEFAULT_IMAGE)
    except Exception as e:  # daemon down or image missing: the message says which
        pytest.skip(f"Docker sandbox unavailable ({e}); `make test` starts dockerd and builds the image")
    return backend


@pytest.fixture
def run_id(docker: DockerBackend) -> Iterator[str]:
    """A run id of this test's own for sandboxes; its containers are reaped after it, and none may be left."""
    run = f"test-{uuid.uuid4().hex[:12]}"
    yield run
    docker.reap(run_id=run)
    assert docker.list_containers(run) == []
