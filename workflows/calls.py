"""Calling activities from workflows: by reference, with the options declared beside each activity.

Invariant: no workflow names an activity by a string; a renamed or removed activity is an import or
type error, never a workflow stuck on an activity no worker has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.calls import options_of


async def call(
    fn: Callable[..., Any],
    *args: Any,
    retry: RetryPolicy | None = None,
    start_to_close: timedelta | None = None,
    summary: str | None = None,
    task_queue: str | None = None,
    schedule_to_start: timedelta | None = None,
    local: bool | None = None,
) -> Any:
    """Run the activity method ``fn`` (``Class.method``) with its declared options; returns its result.

    ``task_queue`` sends it to a queue other than the workflow's (a sandbox host's), where
    ``schedule_to_start`` bounds the wait for a worker to pick it up (a host that is gone answers with a
    non-retried ScheduleToStart timeout instead of a wait without end). Regular activities only.
    ``local`` overrides the declared kind (an activity declared regular may run as a local activity for
    callers that choose so, as rollouts with ``local_model_calls`` do).
    """
    opts = options_of(fn)
    if local is not None and local != opts.local:
        opts = dataclasses.replace(opts, local=local)
    kw = opts.kwargs(retry=retry, start_to_close=start_to_close)
    if summary is not None:
        kw["summary"] = summary
    if task_queue is not None:
        assert not opts.local, f"{fn.__qualname__}: a local activity runs on the workflow's worker"
        kw["task_queue"] = task_queue
        if schedule_to_start is not None:
            kw["schedule_to_start_timeout"] = schedule_to_start
    if opts.local:
        return await workflow.execute_local_activity_method(fn, args=list(args), **kw)
    return await workflow.execute_activity_method(fn, args=list(args), **kw)
