"""The sandbox reaper: removes containers whose rollout workflow is no longer running.

Invariant: a container is kept while its rollout's workflow (workflow id = sandbox key = rollout id; a
rollout's further sandboxes are keyed ``<rollout id>#<name>``: `sandboxes.base.sibling_key`) is
running; a finished, terminated or timed-out workflow's container is removed. This covers what the
workflow's own finalize path cannot: a rollout terminated from the UI or CLI runs no code.

A container whose workflow this namespace does not know is another deployment's (a worker of another
namespace or another Temporal cluster on the same Docker daemon), so it is kept unless ``unknown=True``
(``rollouts reap --unknown``): the reaper of one deployment never removes another's sandboxes. Its own
rollouts' containers are reaped while their histories exist (the namespace's retention, a day or more).
"""

from __future__ import annotations

import asyncio
import logging

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from durable_rollouts.sandboxes import AsyncSandboxBackend
from durable_rollouts.sandboxes.base import owner_key
from durable_rollouts.sandboxes.pool import SandboxPool

log = logging.getLogger(__name__)


async def _in_use(client: Client, workflow_id: str, unknown: bool) -> bool:
    """Whether the sandbox of ``workflow_id`` must stay: its workflow runs, or (unless ``unknown``) this
    namespace does not know it."""
    try:
        desc = await client.get_workflow_handle(workflow_id).describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return not unknown
        raise
    return desc.status == WorkflowExecutionStatus.RUNNING


async def reap_orphans(
    client: Client,
    backend: AsyncSandboxBackend,
    run_id: str | None = None,
    min_age_s: float = 30.0,
    pool: SandboxPool | None = None,
    unknown: bool = False,
) -> list[str]:
    """Remove the project's containers (of one run, or all) whose rollout has ended; returns names.

    ``unknown``: also those whose workflow this namespace does not know (another deployment's, or one past
    retention). With ``pool``, also give back the slots of rollouts that have ended (a terminated rollout
    never runs its destroy step).
    """
    infos = await backend.list_containers(run_id)
    keep = {info.key for info in infos if await _in_use(client, owner_key(info.key), unknown)}
    removed = await backend.reap(run_id=run_id, older_than_s=min_age_s, keep=keep)
    if pool is not None:
        for key in await asyncio.to_thread(pool.holders):
            mine = run_id is None or key.startswith(f"{run_id}/")
            if mine and key not in keep and not await _in_use(client, key, unknown):
                await asyncio.to_thread(pool.release, key)
    return removed


async def reap_forever(
    client: Client,
    backend: AsyncSandboxBackend,
    every_s: float = 60.0,
    pool: SandboxPool | None = None,
    first_s: float | None = None,
) -> None:
    """Run the reaper periodically (a worker's background task); errors are logged, never fatal.

    The first pass comes ``first_s`` after the start (default ``every_s``): a sandbox host that rejoins
    reaps at once what its rollouts left while it was gone."""
    wait = every_s if first_s is None else first_s
    while True:
        await asyncio.sleep(wait)
        wait = every_s
        try:
            removed = await reap_orphans(client, backend, pool=pool)
        except Exception as e:  # a daemon hiccup must not take the worker down
            log.warning("sandbox reaper: %s", e)
            continue
        if removed:
            log.info("sandbox reaper removed %d orphaned containers: %s", len(removed), removed)
