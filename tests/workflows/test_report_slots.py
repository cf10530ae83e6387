"""A group's report waits on the run, and must not hold the worker slot the run needs to answer it.

A group closes in one local activity (``report_group``) that writes its record and sends the run's
``group_report`` update; a local activity holds its workflow's task open, and so one of the worker's
workflow-task slots, while the run's own workflow task, which completes the update, needs a slot of its
own. With every slot held by a group waiting on its report, no report could ever be answered (seen with
four slots under load: tests/integration/test_admission_backlog.py's control run stalled). A try now waits
at most ``REPORT_WAIT_S`` and the close's retries wait on a durable timer, which ends the group's task.
Dev server (the real update path)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rollouts.config.models import AdmissionSection
from durable_rollouts.contracts.types import group_id
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import Fakes, admitted_run, fake_worker

SLOTS = 2


@pytest.mark.timeout(120)
async def test_groups_waiting_on_their_reports_in_every_slot_still_reach_the_run(
    client: Client, uid: str
) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    held: list[str] = []
    together = asyncio.Event()

    async def in_every_slot_at_once(inp: Any) -> None:  # the first SLOTS reports are sent together
        if len(held) < SLOTS:
            held.append(inp.finalize.record.group_id)
            if len(held) == SLOTS:
                together.set()
            await together.wait()

    fakes.report_hook = in_every_slot_at_once
    groups = 4
    inp = admitted_run(uid, AdmissionSection(), groups=groups, size=1, inflight=groups)  # a fixed cap
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes, workflow_slots=SLOTS):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result = await asyncio.wait_for(handle.result(), 60)  # without the bound and the timer: never
    assert result.done and result.groups_done == groups, result
    assert len(held) == SLOTS
    reported = [c.finalize.record.group_id for c in fakes.calls["report_group"]]
    assert sorted(set(reported)) == [group_id(i) for i in range(groups)]
    for gid in held:  # each held group's first try gave up; its retry waited on a timer, outside its task
        events = [
            e.event_type
            async for e in client.get_workflow_handle(f"{inp.run_id}/{gid}").fetch_history_events()
        ]
        assert EventType.EVENT_TYPE_TIMER_STARTED in events, gid
        assert reported.count(gid) >= 2, (gid, reported)
