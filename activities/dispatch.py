"""The dispatcher's activities (RunWorkflow's, as it starts and watches its groups): its poll (engine metrics,
record counts of the groups in flight, the sandbox pool) and its look at groups closed without reporting.

Invariants:
- Read-only except for the dispatch log, whose rows are keyed by (run, seq): a retried poll writes the
  previous decision once, and for the re-publish it starts to an engine held out of rotation.
- An engine that serves an older policy version than the current one (restarted from its files, or a new
  replica; ``engines.rejoin``) gives no reading (one line of the poll's errors says why), so it ages out of
  the healthy engines and no new group goes to it; its re-publish is started in the background (at most one
  per engine and version in this worker) and the first poll that finds it current gives its reading again.
- An engine that does not answer, or answers with an incomplete /metrics, gives no reading (the error is
  returned as one line); the workflow keeps its older reading, which ages out and makes it unhealthy.
- Every engine is asked at once with a short timeout, so one hung engine delays a poll by at most that.
- What a poll read and the decision it carries set this worker's dispatcher gauges (``metrics.record_poll``).
- Given the run's task queue, a poll also reads the orchestration's backlog from Temporal (rule O of
  admission/controller.py), two calls at once: the queue's workflow-task stats (``DescribeTaskQueue``) and
  the run's own latest history events (the schedule-to-start of its workflow tasks, sticky ones included).
  A failed call is one line of the poll's errors; with both failed the poll gives no backlog.
- ``closed_groups`` and ``terminated_group`` ask Temporal (describe only, activities/closed_groups.py) through
  the worker's client (``activity.client()``), which every async activity has.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta

import httpx
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    DescribeTaskQueueRequest,
    GetWorkflowExecutionHistoryReverseRequest,
)
from temporalio.client import Client
from temporalio.common import RetryPolicy

from durable_rollouts import metrics
from durable_rollouts.activities.calls import Options, options
from durable_rollouts.activities.closed_groups import closed_among, unended_members
from durable_rollouts.contracts.activity_io import ClosedGroupsInput, TerminatedGroup, TerminatedGroupInput
from durable_rollouts.contracts.types import (
    EngineReading,
    FleetPoll,
    GroupCounts,
    GroupResult,
    Outcome,
    PollFleetInput,
    QueueBacklog,
    RolloutResult,
)
from durable_rollouts.engines.metrics import fetch_reading
from durable_rollouts.engines.rejoin import EngineGate, Held
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.store.runstore import RunStore

METRICS_TIMEOUT_S = 3.0
OWN_EVENTS = 30
"""History events of the run read back per poll: its last few workflow tasks (one poll's worth or more)."""


async def read_backlog(
    client: Client, queue: str, workflow_id: str, run_id: str | None, now: float
) -> tuple[QueueBacklog | None, list[str]]:
    """The orchestration's backlog (`queue_backlog` with `own_wait`'s latency) and the errors of its calls,
    one line each; None when both failed."""
    stats, own = await asyncio.gather(
        queue_backlog(client, queue, now), own_wait(client, workflow_id, run_id), return_exceptions=True
    )
    errors = [
        f"{what}: {type(e).__name__}: {e}"[:300]
        for what, e in ((f"task queue {queue}", stats), (f"history of {workflow_id}", own))
        if isinstance(e, BaseException)
    ]
    if isinstance(stats, BaseException) and isinstance(own, BaseException):
        return None, errors
    backlog = (
        stats if isinstance(stats, QueueBacklog) else QueueBacklog(task_queue=queue, at=now, reported=False)
    )
    if not isinstance(own, BaseException):
        backlog = backlog.model_copy(update={"latency_s": own})
    return backlog, errors


async def own_wait(client: Client, workflow_id: str, run_id: str | None) -> float | None:
    """The longest schedule-to-start wait of the workflow's workflow tasks among its last ``OWN_EVENTS``
    history events (a task counts once its started event is there); None when they hold no started task."""
    resp = await client.workflow_service.get_workflow_execution_history_reverse(
        GetWorkflowExecutionHistoryReverseRequest(
            namespace=client.namespace,
            execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id or ""),
            maximum_page_size=OWN_EVENTS,
        ),
        timeout=timedelta(seconds=METRICS_TIMEOUT_S),
    )
    scheduled = {
        e.event_id: e.event_time.ToMicroseconds()
        for e in resp.history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED
    }
    waits = [
        (e.event_time.ToMicroseconds() - scheduled[sid]) / 1e6
        for e in resp.history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
        and (sid := e.workflow_task_started_event_attributes.scheduled_event_id) in scheduled
    ]
    return max(0.0, *waits) if waits else None


async def queue_backlog(client: Client, queue: str, now: float) -> QueueBacklog:
    """The workflow-task backlog of ``queue`` as the server reports it (its stats are refreshed every few
    seconds); ``reported`` is False when the server gives no stats."""
    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            report_stats=True,
        ),
        timeout=timedelta(seconds=METRICS_TIMEOUT_S),
    )
    if not resp.HasField("stats"):
        return QueueBacklog(task_queue=queue, at=now, reported=False)
    s = resp.stats
    return QueueBacklog(
        task_queue=queue,
        at=now,
        count=max(0, s.approximate_backlog_count),
        age_s=max(0.0, s.approximate_backlog_age.ToTimedelta().total_seconds()),
        add_rate=max(0.0, s.tasks_add_rate),
        dispatch_rate=max(0.0, s.tasks_dispatch_rate),
    )


class DispatchActivities:
    """The activities of the dispatcher: the poll RunWorkflow makes each admission round, and its checks of
    groups that closed without reporting (registered by every worker)."""

    def __init__(self, store: RunStore, pool: SandboxPool, gate: EngineGate | None = None) -> None:
        self.store = store
        self.pool = pool
        self.gate = gate or EngineGate(store)
        """Which engines serve the current policy version (and re-publishes to those that do not)."""
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(METRICS_TIMEOUT_S))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        await self.gate.aclose()

    @options(
        Options(
            timedelta(seconds=30),
            RetryPolicy(maximum_attempts=3, maximum_interval=timedelta(seconds=5)),
            local=True,
        )
    )
    @activity.defn
    async def poll_fleet(self, inp: PollFleetInput) -> FleetPoll:
        """Read every engine's /metrics, the run's group counts and the pool; log the last decision."""
        if inp.log is not None:
            await asyncio.to_thread(
                self.store.put_dispatch_log, inp.run_id, inp.log.seq, inp.log.at, inp.log.model_dump()
            )
        now = time.time()
        backlog_read = None
        if inp.task_queue is not None:
            info = activity.info()
            backlog_read = asyncio.ensure_future(
                read_backlog(
                    activity.client(),
                    inp.task_queue,
                    info.workflow_id or inp.run_id,
                    info.workflow_run_id,
                    now,
                )
            )
        policies = await asyncio.to_thread(self.store.policies)
        results, holds = await asyncio.gather(
            asyncio.gather(
                *(fetch_reading(self.http, url, url, now) for url in inp.engine_urls), return_exceptions=True
            ),
            asyncio.gather(*(self.gate.held(url, policies) for url in inp.engine_urls)),
        )
        readings: list[EngineReading] = []
        errors: list[str] = []
        backlog = None
        if backlog_read is not None:
            backlog, backlog_errors = await backlog_read
            errors += backlog_errors
        for url, r, held in zip(inp.engine_urls, results, holds, strict=True):
            if isinstance(r, BaseException):
                errors.append(f"{url}: {type(r).__name__}: {r}"[:300])
            elif isinstance(held, Held):
                errors.append(held.describe()[:300])
            else:
                readings.append(r)
        counts = await asyncio.to_thread(self.store.group_counts, inp.run_id, inp.groups)
        pool = None
        if inp.pool is not None:
            pool = await asyncio.to_thread(self.pool.status, inp.pool)
        unconsumed = 0
        if inp.count_unconsumed:
            unconsumed = await asyncio.to_thread(self.store.unconsumed_groups, inp.run_id)
        poll = FleetPoll(
            at=now,
            unconsumed_groups=unconsumed,
            readings=readings,
            errors=errors,
            counts={
                g: GroupCounts(finished=f, admission_cancelled=c, complete=k, complete_tokens=t)
                for g, (f, c, k, t) in counts.items()
            },
            pool=pool,
            backlog=backlog,
        )
        metrics.record_poll(inp.run_id, inp.log, poll, inp.engine_urls, inp.count_unconsumed)
        return poll

    @options(Options(timedelta(seconds=30), RetryPolicy(maximum_interval=timedelta(seconds=10)), local=True))
    @activity.defn
    async def terminated_group(self, inp: TerminatedGroupInput) -> TerminatedGroup:
        """What the store holds of a group terminated by hand (read-only): its task, every member attempt
        with a record, and its own record if it wrote one before it was terminated; given the group's
        ``size``, also its member attempts that Temporal holds and that did not complete."""

        def read() -> TerminatedGroup:
            rows = self.store.rollouts(inp.run_id, inp.group_id)
            group = self.store.group(inp.run_id, inp.group_id)
            task_id = group["task_id"] if group else rows[0]["task_id"] if rows else None
            if task_id is None:
                task_id = self.store.task_at(inp.run_id, inp.task_index)["id"]
            members = [
                RolloutResult(
                    rollout_id=r["rollout_id"],
                    sample_index=r["sample_index"],
                    outcome=Outcome(r["outcome"]),
                    reason=r["reason"],
                    reward=r["reward"],
                    scorable=bool(r["scorable"]),
                    num_tokens=r["num_tokens"],
                    wasted_tokens=int(json.loads(r["extra_json"]).get("wasted_tokens", 0)),
                )
                for r in rows
            ]
            record = GroupResult.model_validate(group) if group else None
            # attempts that ran inside the group's workflow (group.inline_rollouts) have no workflow for
            # Temporal to list: those that stored tokens and no record are unended too
            began = self.store.unrecorded_with_segments(f"{inp.run_id}/{inp.group_id}/")
            return TerminatedGroup(task_id=str(task_id), members=members, record=record, unended=began)

        seen = await asyncio.to_thread(read)
        if inp.size > 0:
            unended = await unended_members(activity.client(), inp.run_id, inp.group_id, inp.size)
            seen = seen.model_copy(update={"unended": list(dict.fromkeys([*unended, *seen.unended]))})
        return seen

    @options(
        Options(
            timedelta(seconds=30),
            RetryPolicy(maximum_attempts=3, maximum_interval=timedelta(seconds=5)),
            local=True,
        )
    )
    @activity.defn
    async def closed_groups(self, inp: ClosedGroupsInput) -> dict[str, str]:
        """Of the run's groups ``inp`` names, those whose workflow has closed, with its status's name."""
        return await closed_among(activity.client(), inp.run_id, inp.groups)

    def all(self) -> list:
        return [self.poll_fleet, self.terminated_group, self.closed_groups]
