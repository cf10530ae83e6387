"""Fixtures of the SWE environment's tests: the bundled tasks, and real Docker sandboxes bound as the
environment's `Sandbox` (the way the pipeline hands one to an environment).

No ``__init__.py`` here: these test modules are imported by their own names (``test_swe_*``), so they never
collide with the core's ``tests`` package.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from swe_env import SweEnvironment, SweTask
from swe_env.transcripts import TASKS

from durable_rollouts.environments.base import SandboxPlan, TurnContext
from durable_rollouts.sandboxes import AsyncSandboxBackend, DockerBackend, SandboxHandle
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE, ExecResult, SandboxSpec

PACKAGE = Path(__file__).resolve().parents[1]
SPEC = SandboxSpec(memory_mb=512, workdir_size_mb=64, tmp_size_mb=64, command_timeout_s=30)
"""The run's default sandbox section, as a test run would set it."""


class BoundSandbox:
    """A Docker sandbox bound to its container: the environment's `environments.base.Sandbox`."""

    def __init__(self, backend: AsyncSandboxBackend, handle: SandboxHandle) -> None:
        self.backend = backend
        self.handle = handle

    async def exec(self, cmd: str, timeout_s: float | None = None, once_key: str | None = None) -> ExecResult:
        return await self.backend.exec(self.handle, cmd, timeout_s)

    async def write_file(self, path: str, content: bytes | str) -> None:
        await self.backend.write_file(self.handle, path, content)

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        return await self.backend.read_file(self.handle, path, max_bytes)


@pytest.fixture(scope="session")
def default_spec() -> SandboxSpec:
    """The run's ``[sandbox]`` section the tests' plans start from."""
    return SPEC


@pytest.fixture(scope="session")
def env() -> SweEnvironment:
    return SweEnvironment()


@pytest.fixture(scope="session")
def tasks(env: SweEnvironment) -> list[SweTask]:
    return [t for t in env.load_tasks(TASKS) if isinstance(t, SweTask)]


@pytest.fixture(scope="session")
def docker() -> DockerBackend:
    """The Docker backend, with the SWE images built (offline, idempotent); skips without Docker."""
    try:
        backend = DockerBackend()
        backend.client.images.get(DEFAULT_IMAGE)
    except Exception as e:  # daemon down or base image missing: the message says which
        pytest.skip(f"Docker sandbox unavailable ({e}); `make test` starts dockerd and builds the base image")
    done = subprocess.run(
        ["bash", str(PACKAGE / "build_images.sh")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return backend


Setup = Callable[..., Awaitable[TurnContext]]


@pytest.fixture
async def sandbox_for(docker: DockerBackend, env: SweEnvironment) -> AsyncIterator[Setup]:
    """Create a task's sandbox from its plan and run the plan's setup, as the pipeline does; every sandbox
    is destroyed when the test ends."""
    backend = AsyncSandboxBackend(docker)
    keys: list[str] = []

    async def setup(task: SweTask, key: str, spec: SandboxSpec = SPEC) -> TurnContext:
        plan = env.sandbox(task, spec)
        assert isinstance(plan, SandboxPlan)
        keys.append(key)
        handle = await backend.create(key, "swe-tests", plan.spec)
        box = BoundSandbox(backend, handle)
        for path, content in plan.files.items():
            await box.write_file(path, content)
        for cmd in plan.setup:
            res = await box.exec(cmd, timeout_s=plan.setup_timeout_s)
            assert res.exit_code == 0, (cmd, res.output)
        return TurnContext(task=task, rollout_id=key, turn=0, last_turn=False, sandbox=box)

    yield setup
    for key in keys:
        await backend.destroy(key)
