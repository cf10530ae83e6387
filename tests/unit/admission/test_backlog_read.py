"""Rule O's signal: the poll's reading of the run's task queue backlog (activities/dispatch.py), against a
stand-in for Temporal's workflow service that answers as a server with and without stats does."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from google.protobuf.duration_pb2 import Duration
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.history.v1 import History, HistoryEvent
from temporalio.api.taskqueue.v1 import TaskQueueStats
from temporalio.api.workflowservice.v1 import (
    DescribeTaskQueueResponse,
    GetWorkflowExecutionHistoryReverseResponse,
)

from durable_rollouts.activities.dispatch import own_wait, queue_backlog, read_backlog


class Service:
    def __init__(self, resp: DescribeTaskQueueResponse, history: list[HistoryEvent] | None = None) -> None:
        self.resp, self.history = resp, history
        self.asked: list[Any] = []

    async def get_workflow_execution_history_reverse(
        self, req: Any, timeout: timedelta | None = None
    ) -> GetWorkflowExecutionHistoryReverseResponse:
        self.asked.append((req, timeout))
        if self.history is None:
            raise RuntimeError("history unavailable")
        return GetWorkflowExecutionHistoryReverseResponse(history=History(events=self.history))

    async def describe_task_queue(
        self, req: Any, timeout: timedelta | None = None
    ) -> DescribeTaskQueueResponse:
        self.asked.append((req, timeout))
        return self.resp


def client(resp: DescribeTaskQueueResponse, history: list[HistoryEvent] | None = None) -> Any:
    return SimpleNamespace(namespace="ns", workflow_service=Service(resp, history))


def event(event_id: int, kind: int, at_s: float, scheduled: int = 0) -> HistoryEvent:
    e = HistoryEvent(event_id=event_id, event_type=kind)
    e.event_time.FromMicroseconds(int(at_s * 1e6))
    if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
        e.workflow_task_started_event_attributes.scheduled_event_id = scheduled
    return e


SCHEDULED, STARTED = EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED


async def test_the_workflow_task_backlog_is_read_in_one_call_with_stats() -> None:
    age = Duration()
    age.FromTimedelta(timedelta(seconds=2, milliseconds=500))
    stats = TaskQueueStats(
        approximate_backlog_count=37,
        approximate_backlog_age=age,
        tasks_add_rate=12.5,
        tasks_dispatch_rate=8.0,
    )
    c = client(DescribeTaskQueueResponse(stats=stats))
    b = await queue_backlog(c, "runs", 100.0)
    assert (b.task_queue, b.at, b.reported, b.count, b.age_s) == ("runs", 100.0, True, 37, 2.5)
    assert (b.add_rate, b.dispatch_rate) == (12.5, 8.0)
    [(req, timeout)] = c.workflow_service.asked
    assert req.namespace == "ns" and req.task_queue.name == "runs" and req.report_stats
    assert req.task_queue_type == TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW and timeout is not None


async def test_a_server_without_stats_gives_an_unreported_backlog() -> None:
    b = await queue_backlog(client(DescribeTaskQueueResponse()), "runs", 1.0)
    assert not b.reported and b.count == 0 and b.age_s == 0.0


async def test_the_runs_own_wait_is_the_longest_schedule_to_start_among_its_latest_workflow_tasks() -> None:
    # newest first, as the reverse history comes: a task that waited 2.5 s, one of 0.25 s, and a started
    # event whose scheduled event lies beyond the page (not counted)
    history = [
        event(9, STARTED, 20.0, scheduled=8),
        event(8, SCHEDULED, 17.5),
        event(5, EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, 12.0),
        event(4, STARTED, 10.25, scheduled=3),
        event(3, SCHEDULED, 10.0),
        event(2, STARTED, 9.0, scheduled=1),
    ]
    c = client(DescribeTaskQueueResponse(), history)
    assert await own_wait(c, "run", "r1") == 2.5
    [(req, _)] = c.workflow_service.asked
    assert req.execution.workflow_id == "run" and req.execution.run_id == "r1" and req.maximum_page_size > 0
    assert (
        await own_wait(client(DescribeTaskQueueResponse(), [event(3, SCHEDULED, 1.0)]), "run", None) is None
    )


async def test_one_failed_call_leaves_the_other_reading_and_says_why_in_one_line() -> None:
    history = [event(2, STARTED, 3.0, scheduled=1), event(1, SCHEDULED, 1.0)]
    b, errors = await read_backlog(client(DescribeTaskQueueResponse(), history), "runs", "run", "r1", 5.0)
    assert b is not None and not b.reported and b.latency_s == 2.0 and b.seen and b.wait_s == 2.0
    assert errors == []
    b, errors = await read_backlog(client(DescribeTaskQueueResponse(), None), "runs", "run", "r1", 5.0)
    assert b is not None and not b.seen  # no stats and no history: rule O says it is inactive
    assert errors == ["history of run: RuntimeError: history unavailable"]
