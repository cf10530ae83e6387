"""A real sandbox frozen by ``docker pause`` whose ``docker unpause`` cannot be used (it times out at once,
as the hung unpause of a chaos soak did) runs again within seconds: the fault kit thaws its freezer cgroup
directly and brings Docker's state back to running, so a command in it answers.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import requests

from durable_rollouts.faults import containers, freezer
from durable_rollouts.sandboxes import DEFAULT_IMAGE, DockerBackend, SandboxSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SMALL = SandboxSpec(
    memory_mb=256, cpus=1.0, pids_limit=64, workdir_size_mb=64, tmp_size_mb=16, command_timeout_s=10
)


class UnpauseTimesOut:
    """The sandbox's container as the fault kit sees it, except that its first ``docker unpause`` raises the
    client's read timeout at once (later calls reach Docker: the daemon answers again once thawed)."""

    def __init__(self, container: Any) -> None:
        self._c = container
        self.timed_out = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    def unpause(self) -> None:
        if not self.timed_out:
            self.timed_out += 1
            raise requests.exceptions.ReadTimeout("Read timed out. (read timeout=0)")
        self._c.unpause()


@pytest.fixture
def backend() -> DockerBackend:
    try:
        backend = DockerBackend()
        backend.api.inspect_image(DEFAULT_IMAGE)
    except Exception as exc:  # no daemon, or no image
        pytest.skip(f"docker daemon or image {DEFAULT_IMAGE} unavailable: {exc}")
    return backend


@pytest.fixture
def run_id(backend: DockerBackend):
    run = f"test-pause-{uuid.uuid4().hex[:8]}"
    yield run
    backend.reap(run_id=run)
    assert backend.list_containers(run) == []


def test_a_paused_sandbox_whose_unpause_times_out_runs_again(
    backend: DockerBackend, run_id: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    handle = backend.create(f"{run_id}/0", run_id, SMALL)
    container = backend.client.containers.get(handle.container_id)
    fz = freezer.find(container.id)
    if fz is None:
        pytest.skip(f"no freezer cgroup of the container under {freezer.CGROUP_ROOT}")
    monkeypatch.setattr(containers, "DOCKER_WAIT_S", 2.0, raising=False)
    victim = UnpauseTimesOut(container)
    caplog.set_level("WARNING", logger=containers.__name__)
    with containers.paused(victim):
        assert fz.state() == freezer.FROZEN
    t0 = time.monotonic()
    result = backend.exec(handle, "echo answers", timeout_s=5)
    took = time.monotonic() - t0
    assert victim.timed_out == 1 and fz.state() == freezer.THAWED
    assert (result.exit_code, result.output.strip()) == (0, "answers") and took < 5.0
    assert "thawed its freezer directly (FROZEN; docker unpause: ReadTimeout" in caplog.text


def test_a_pause_that_fails_on_a_frozen_sandbox_leaves_it_thawed(backend: DockerBackend, run_id: str) -> None:
    """A failed freeze left behind Docker's back (runc's "unable to freeze" can leave the cgroup FREEZING):
    the next ``docker pause`` fails, and the fault thaws the sandbox before it reports the error."""
    handle = backend.create(f"{run_id}/0", run_id, SMALL)
    container = backend.client.containers.get(handle.container_id)
    fz = freezer.find(container.id)
    if fz is None:
        pytest.skip(f"no freezer cgroup of the container under {freezer.CGROUP_ROOT}")
    assert fz.set(freezer.FROZEN, 5.0)
    failed = pytest.raises(containers.ContainerFaultError, match="docker pause failed")
    with failed as err, containers.paused(container):
        pytest.fail("the body of a pause that failed ran")
    assert "thawed its freezer directly (FROZEN" in str(err.value) and fz.state() == freezer.THAWED
    result = backend.exec(handle, "echo answers", timeout_s=5)
    assert (result.exit_code, result.output.strip()) == (0, "answers")
