"""The sandbox reaper: removes containers whose rollout workflow is no longer running.

Invariant: a container is kept while its rollout's workflow (workflow id = sandbox key = rollout id) is
running; a terminated, timed-out or unknown workflow's container is removed. This covers what the
workflow's own finalize path cannot: a rollout terminated from the UI or CLI runs no code.
"""

from __future__ import annotations

import asyncio
import logging

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from sandboxes import AsyncSandboxBackend

log = logging.getLogger(__name__)


async def _running(client: Client, workflow_id: str) -> bool:
    try:
        desc = await client.get_workflow_handle(workflow_id).describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return desc.status == WorkflowExecutionStatus.RUNNING


async def reap_orphans(
    client: Client, backend: AsyncSandboxBackend, run_id: str | None = None, min_age_s: float = 30.0
) -> list[str]:
    """Remove the project's containers (of one run, or all) whose rollout is not running; returns names."""
    keep = {info.key for info in await backend.list_containers(run_id) if await _running(client, info.key)}
    return await backend.reap(run_id=run_id, older_than_s=min_age_s, keep=keep)


async def reap_forever(client: Client, backend: AsyncSandboxBackend, every_s: float = 60.0) -> None:
    """Run the reaper periodically (a worker's background task); errors are logged, never fatal."""
    while True:
        await asyncio.sleep(every_s)
        try:
            removed = await reap_orphans(client, backend)
        except Exception as e:  # a daemon hiccup must not take the worker down
            log.warning("sandbox reaper: %s", e)
            continue
        if removed:
            log.info("sandbox reaper removed %d orphaned containers: %s", len(removed), removed)
