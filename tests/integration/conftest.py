"""Fixtures shared by the integration tests (the session-wide ones live in tests/conftest.py)."""

from __future__ import annotations

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
