"""The one place a Temporal client is built: pydantic models cross the wire through the pydantic data
converter, which is part of the contract (every client, worker and replayer uses it)."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime


async def connect(address: str, namespace: str = "default", runtime: Runtime | None = None) -> Client:
    """Connect to Temporal with the project's data converter; ``runtime`` (e.g. one that serves the SDK's
    metrics, see ``metrics.serve.temporal_runtime``) defaults to the SDK's."""
    return await Client.connect(
        address, namespace=namespace, data_converter=pydantic_data_converter, runtime=runtime
    )
