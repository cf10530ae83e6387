"""What Temporal holds of a run's groups and their members (for the run's accounting of a group that closed
without reporting, workflows/closed_groups.py and workflows/unreported.py). Read-only: describes only.

Describe, not visibility: it is exact at once (visibility lags, and Temporal's test server has none), and
the sets asked about are small (the groups a segment carried over continue-as-new; one closed group's
member attempts, whose ids are deterministic: ``<run>/<group>/<i>``, then ``<i>r1``, ``<i>r2``, ...).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

DESCRIBE_TIMEOUT = timedelta(seconds=5)
CONCURRENCY = 16
"""Describes in flight at once."""
MAX_ATTEMPTS_PROBED = 100
"""Attempt ids probed per slot at most (a slot runs again only on admission cancels and manual retries)."""

_OPEN = (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW)


async def _status(client: Client, wid: str, gate: asyncio.Semaphore) -> WorkflowExecutionStatus | None:
    """The workflow's status; None when it does not exist."""
    async with gate:
        try:
            desc = await client.get_workflow_handle(wid).describe(rpc_timeout=DESCRIBE_TIMEOUT)
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
    return desc.status


async def closed_among(client: Client, run_id: str, groups: list[str]) -> dict[str, str]:
    """Of the run's ``groups``, those whose workflow has closed, with their status's name (``TERMINATED``,
    ``FAILED``, ``TIMED_OUT``, ``CANCELED``, ``COMPLETED``). One that does not exist is left out."""
    gate = asyncio.Semaphore(CONCURRENCY)
    statuses = await asyncio.gather(*(_status(client, f"{run_id}/{g}", gate) for g in groups))
    return {g: s.name for g, s in zip(groups, statuses, strict=True) if s is not None and s not in _OPEN}


async def unended_members(client: Client, run_id: str, group_id: str, size: int) -> list[str]:
    """The group's member attempts that exist and did not complete (running, terminated, failed, timed out,
    cancelled): the ones that may have no record. Attempts of a slot are probed until one does not exist."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def slot(i: int) -> list[str]:
        out = []
        for n in range(MAX_ATTEMPTS_PROBED):
            wid = f"{run_id}/{group_id}/{i}" + (f"r{n}" if n else "")
            status = await _status(client, wid, gate)
            if status is None:
                break
            if status != WorkflowExecutionStatus.COMPLETED:
                out.append(wid)
        return out

    return [m for ms in await asyncio.gather(*(slot(i) for i in range(size))) for m in ms]
