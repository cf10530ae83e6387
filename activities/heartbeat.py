"""Heartbeating while an activity awaits something slow (a model call, a sandbox command).

Invariant: an activity that waits heartbeats every HEARTBEAT_EVERY_S, so a dead worker is noticed within
the heartbeat timeout and a cancellation reaches the activity; the awaited work is cancelled with it. A
local activity (``rollout.local_model_calls``) does not heartbeat: the server knows nothing of it (the SDK
refuses its heartbeats with a warning each time), and the workflow task that holds it notices a dead
worker instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from temporalio import activity

T = TypeVar("T")
HEARTBEAT_EVERY_S = 2.0


async def heartbeating(aw: Awaitable[T]) -> T:
    """Await aw while heartbeating, so a dead worker is noticed within the heartbeat timeout."""
    task = asyncio.ensure_future(aw)
    beat = not activity.info().is_local
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY_S)
            if done:
                return task.result()
            if beat:
                activity.heartbeat()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
