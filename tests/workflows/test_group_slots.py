"""How the dispatcher starts groups, on the test server with fake activities: the groups admitted at one
decision start in one workflow task (not one after another)."""

from __future__ import annotations

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.config.models import AdmissionSection
from durable_rollouts.contracts.types import group_id

from .fakes import Fakes, admitted_run
from .test_breaker import run


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
async def test_groups_admitted_together_start_in_one_workflow_task(
    ts_env: WorkflowEnvironment, uid: str, adaptive: bool
) -> None:
    ts_client = ts_env.client
    fakes = Fakes()
    fakes.clock = ts_env.get_current_time  # readings on the server's (skipped) clock stay fresh
    fakes.done_on_turn = 1
    admission = AdmissionSection(enabled=adaptive, initial_cap=6, max_inflight=6, admit_window_s=0.0)
    inp = admitted_run(uid, admission, groups=3, size=2, inflight=3)
    result, _ = await run(ts_client, fakes, inp, uid)
    assert result.done and result.groups_done == 3
    events = [e async for e in ts_client.get_workflow_handle(inp.run_id).fetch_history_events()]
    starts = [
        e.start_child_workflow_execution_initiated_event_attributes
        for e in events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    ]
    assert [s.workflow_id for s in starts] == [f"{inp.run_id}/{group_id(g)}" for g in range(3)]
    assert len({s.workflow_task_completed_event_id for s in starts}) == 1, "started one after another"
