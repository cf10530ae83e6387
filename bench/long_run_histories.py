"""The long-run benchmark's reads of Temporal (bench/long_run.py samples; this file asks the server): the
histories of a few rollouts and groups per tenth, the run workflow's current segment, and every segment of
the run with its failed workflow tasks by cause (`rejected_continue_as_new`).

Read-only: it fetches histories, describes and queries workflows through the client given.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowHandle

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.workflows.run import RunWorkflow

HISTORY_SAMPLES = 3
"""Groups per tenth whose histories (the group's and its first member's) are read."""


def turns_of(task_index: int, turns: int) -> int:
    """Turns the scripted rollouts of the ``task_index``-th task take."""
    return 1 + task_index % turns


async def history_size(client: Client, wf_id: str, run_id: str | None = None) -> tuple[int, int]:
    """(events, bytes) of one workflow execution's history."""
    n = size = 0
    async for e in client.get_workflow_handle(wf_id, run_id=run_id).fetch_history_events():
        n += 1
        size += e.ByteSize()
    return n, size


async def run_view(client: Client, run_id: str) -> dict[str, Any]:
    """The run workflow now (its latest segment): the segment's number, history and carried state (its
    input), and the run's search attributes."""
    handle: WorkflowHandle = client.get_workflow_handle(run_id)  # no run id: the latest segment
    desc = await handle.describe()
    n = size = state = 0
    async for e in client.get_workflow_handle(handle.id, run_id=desc.run_id).fetch_history_events():
        if n == 0:
            state = e.workflow_execution_started_event_attributes.input.ByteSize()
        n += 1
        size += e.ByteSize()
    progress = None
    if desc.status is not None and desc.status.name == "RUNNING":
        progress = await handle.query(RunWorkflow.progress)
    return {
        "segment": progress.segment if progress is not None else None,
        "groups_inflight": progress.groups_inflight if progress is not None else None,
        "segment_history_events": n,
        "segment_history_bytes": size,
        "carried_input_bytes": state,
        "search_attributes": len(
            desc.raw_description.workflow_execution_info.search_attributes.indexed_fields
        ),
        "memo_bytes": desc.raw_description.workflow_execution_info.memo.ByteSize(),
    }


def history_picks(part: int, groups: int, tasks: int, turns: int) -> list[int]:
    """``HISTORY_SAMPLES`` groups spread over tenth ``part`` (1-based), each the first from its point on
    whose task takes the most turns, so every tenth samples the same work."""
    lo, hi = groups * (part - 1) // 10, groups * part // 10
    picks = set()
    for j in range(HISTORY_SAMPLES):
        p = lo + (hi - lo) * (j + 1) // (HISTORY_SAMPLES + 1)
        picks.add(next((g for g in range(p, hi) if turns_of(g % tasks, turns) == turns), p))
    return sorted(picks)


async def histories(client: Client, run_id: str, picks: list[int]) -> dict[str, Any]:
    """Histories of the groups ``picks`` and of each one's member 0."""
    r_events, r_bytes, g_events, g_bytes = [], [], [], []
    for g in picks:
        gid = group_id(g)
        n, b = await history_size(client, rollout_id(run_id, gid, 0))
        r_events.append(n)
        r_bytes.append(b)
        n, b = await history_size(client, f"{run_id}/{gid}")
        g_events.append(n)
        g_bytes.append(b)
    mean = lambda xs: round(sum(xs) / len(xs), 1)  # noqa: E731
    return {
        "sampled_groups": [group_id(g) for g in picks],
        "rollout_history_events_mean": mean(r_events),
        "rollout_history_bytes_mean": mean(r_bytes),
        "group_history_events_mean": mean(g_events),
        "group_history_bytes_mean": mean(g_bytes),
    }


async def segments(client: Client, run_id: str) -> list[dict[str, Any]]:
    """Every segment (execution) of the run, oldest first: its history (events, bytes), the state it
    was started with (its input's bytes), the groups it started and the group_done signals it took, its
    workflow tasks that failed (by cause), and the time from its last group start to its last event (the
    continue-as-new; no group starts meanwhile)."""
    runs = sorted(
        [w async for w in client.list_workflows(f"WorkflowId = '{run_id}'")], key=lambda w: w.start_time
    )
    out = []
    for i, w in enumerate(runs):
        events = [e async for e in client.get_workflow_handle(run_id, run_id=w.run_id).fetch_history_events()]
        t = lambda e: e.event_time.ToNanoseconds() / 1e9  # noqa: E731
        starts = [
            t(e)
            for e in events
            if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
        ]
        failed = Counter(
            WorkflowTaskFailedCause.Name(e.workflow_task_failed_event_attributes.cause).removeprefix(
                "WORKFLOW_TASK_FAILED_CAUSE_"
            )
            for e in events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        )
        out.append(
            {
                "segment": i,
                "status": w.status.name if w.status is not None else None,
                "start_s": round((w.start_time - runs[0].start_time).total_seconds(), 2),
                "duration_s": round(t(events[-1]) - t(events[0]), 2),
                "events": len(events),
                "history_bytes": sum(e.ByteSize() for e in events),
                "carried_input_bytes": events[0].workflow_execution_started_event_attributes.input.ByteSize(),
                "groups_started": len(starts),
                "group_done_signals": sum(  # the groups' reports: signals, and updates from revision 3
                    1
                    for e in events
                    if e.event_type
                    in (
                        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
                        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED,
                    )
                ),
                "workflow_task_failures": dict(failed),
                "last_start_to_end_s": round(t(events[-1]) - max(starts), 2) if starts else None,
            }
        )
    return out


def rejected_continue_as_new(segs: list[dict[str, Any]]) -> int:
    """Workflow tasks of the run's segments that the server rejected for an event that arrived while they
    were in flight (``UNHANDLED_COMMAND``): in a segment that continued as new, only the task carrying the
    continue-as-new can be (the run's other tasks issue no closing command)."""
    return sum(
        s["workflow_task_failures"].get("UNHANDLED_COMMAND", 0)
        for s in segs
        if s["status"] == "CONTINUED_AS_NEW"
    )
