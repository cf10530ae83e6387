"""A real sandbox frozen by ``docker pause`` whose ``docker unpause`` cannot be used (it times out at once,
as the hung unpause of a chaos soak did) runs again within seconds: the fault kit thaws its freezer cgroup
directly and brings Docker's state back to running, so a command in it answers; the same when the hang is
the real one (an exec racing the freeze).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import docker
import docker.errors
import pytest
import requests

from durable_rollouts.faults import containers, freezer
from durable_rollouts.sandboxes import DockerBackend, SandboxSpec

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
def backend(docker: DockerBackend) -> DockerBackend:
    """The shared sandbox backend (tests/integration/conftest.py: skips without a daemon or the image)."""
    return docker


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


@pytest.mark.timeout(150)
def test_pauses_racing_execs_always_end_thawed(
    backend: DockerBackend, run_id: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The soak's hang for real: ``docker exec`` in a loop while the sandbox is paused and unpaused; an
    exec that races a freeze hangs ``docker unpause`` (about one cycle in three here), and every cycle
    still ends thawed within a bounded time, with Docker's state running and a command answering."""
    handle = backend.create(f"{run_id}/0", run_id, SMALL)
    container = backend.client.containers.get(handle.container_id)
    fz = freezer.find(container.id)
    if fz is None:
        pytest.skip(f"no freezer cgroup of the container under {freezer.CGROUP_ROOT}")
    stop = threading.Event()

    def execs() -> None:
        api = docker.from_env(timeout=60).api
        while not stop.is_set():
            with contextlib.suppress(docker.errors.DockerException, requests.RequestException):
                api.exec_start(api.exec_create(container.id, ["/bin/true"]))

    monkeypatch.setattr(containers, "DOCKER_WAIT_S", 3.0, raising=False)
    caplog.set_level("WARNING", logger=containers.__name__)
    racer = threading.Thread(target=execs, daemon=True)
    racer.start()
    worst = 0.0
    try:
        for _ in range(12):
            t0 = time.monotonic()
            with containers.paused(container):
                pass
            worst = max(worst, time.monotonic() - t0)
            assert fz.state() == freezer.THAWED
    finally:
        stop.set()
        racer.join(70)
    direct = caplog.text.count("thawed its freezer directly")
    container.reload()
    assert not container.attrs["State"]["Paused"] and worst < 30.0, (direct, worst)  # bound: 8 waits of 3 s
    result = backend.exec(handle, "echo answers", timeout_s=5)
    assert (result.exit_code, result.output.strip()) == (0, "answers"), direct
