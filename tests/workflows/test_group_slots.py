"""How the dispatcher hands out group slots, on the test server with fake activities: a group's slot is
free once its members have ended (the next group starts while the record is still being written), the
groups admitted at one decision start in one workflow task (not one after another), and groups started
ahead of admission (``run.prestart_groups``) wait, held, until released, and are cancelled with their run."""

from __future__ import annotations

import asyncio

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from config.models import AdmissionSection, Config, RolloutConfig, RunConfig
from contracts.types import (
    FinalizeGroupInput,
    GenerateInput,
    Outcome,
    RunInput,
    RunProgress,
    group_id,
    rollout_id,
)
from workflows.group import RUN_CANCEL_REASON
from workflows.run import RunWorkflow

from .fakes import Fakes, fake_worker


async def run(client: Client, fakes: Fakes, inp: RunInput, uid: str) -> RunProgress:
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        return await handle.result()


async def test_the_next_group_starts_while_the_last_one_writes_its_record(
    ts_client: Client, uid: str
) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    inp = RunInput(
        run_id=f"run-{uid}",
        config=Config(
            run=RunConfig(num_groups=2, group_size=2, max_inflight_groups=1),
            rollout=RolloutConfig(max_turns=2),
        ),
    )
    second = f"{inp.run_id}/{group_id(1)}/"
    overlapped: list[bool] = []

    async def slow_record(g: FinalizeGroupInput) -> None:
        """Group 0's record is written only once group 1 is running (or after 10 s, in vain)."""
        if g.record.group_id != group_id(0):
            return
        for _ in range(200):
            if any(c.rollout_id.startswith(second) for c in fakes.calls["generate_turn"]):
                overlapped.append(True)
                return
            await asyncio.sleep(0.05)
        overlapped.append(False)

    fakes.finalize_group_hook = slow_record
    result = await run(ts_client, fakes, inp, uid)
    assert overlapped == [True], "group 1 waited for group 0's record: the slot was held past its members"
    assert result.done and result.groups_done == 2 and result.outcomes == {"completed": 4}
    members = {rollout_id(inp.run_id, group_id(g), i) for g in range(2) for i in range(2)}
    assert set(fakes.records) == members and all(len(fakes.finalized(r)) == 1 for r in members)
    assert sorted(g.record.group_id for g in fakes.calls["finalize_group"]) == [group_id(0), group_id(1)]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
async def test_groups_admitted_together_start_in_one_workflow_task(
    ts_env: WorkflowEnvironment, uid: str, adaptive: bool
) -> None:
    ts_client = ts_env.client
    fakes = Fakes()
    fakes.clock = ts_env.get_current_time  # readings on the server's (skipped) clock stay fresh
    fakes.done_on_turn = 1
    admission = AdmissionSection(enabled=adaptive, initial_cap=6, max_inflight=6, admit_window_s=0.0)
    inp = RunInput(
        run_id=f"run-{uid}",
        config=Config(
            run=RunConfig(num_groups=3, group_size=2, max_inflight_groups=3),
            rollout=RolloutConfig(max_turns=2),
            admission=admission,
        ),
    )
    result = await run(ts_client, fakes, inp, uid)
    assert result.done and result.groups_done == 3
    events = [e async for e in ts_client.get_workflow_handle(inp.run_id).fetch_history_events()]
    starts = [
        e.start_child_workflow_execution_initiated_event_attributes
        for e in events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    ]
    assert [s.workflow_id for s in starts] == [f"{inp.run_id}/{group_id(g)}" for g in range(3)]
    assert len({s.workflow_task_completed_event_id for s in starts}) == 1, "started one after another"


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
async def test_held_groups_start_ahead_and_run_only_once_released(
    ts_env: WorkflowEnvironment, uid: str, adaptive: bool
) -> None:
    """One group in flight, one held: each group's workflow and members start before its admission, its
    members call the model only after the group before has ended them all, and every member runs once."""
    fakes = Fakes()
    fakes.clock = ts_env.get_current_time
    fakes.done_on_turn = 2
    admission = AdmissionSection(enabled=adaptive, initial_cap=2, max_inflight=2, admit_window_s=0.0)
    inp = RunInput(
        run_id=f"run-{uid}",
        config=Config(
            run=RunConfig(num_groups=4, group_size=2, max_inflight_groups=1, prestart_groups=1),
            rollout=RolloutConfig(max_turns=3),
            admission=admission,
        ),
    )
    overlaps: list[str] = []

    async def one_group_at_a_time(g: GenerateInput) -> None:
        k = int(g.rollout_id.split("/")[-2].removeprefix("g"))
        if k and not all(rollout_id(inp.run_id, group_id(k - 1), i) in fakes.records for i in range(2)):
            overlaps.append(g.rollout_id)

    fakes.generate_hook = one_group_at_a_time
    result = await run(ts_env.client, fakes, inp, uid)
    assert overlaps == [], "a held group's member ran before the group ahead of it had ended"
    assert result.done and result.groups_done == 4 and result.outcomes == {"completed": 8}
    members = {rollout_id(inp.run_id, group_id(g), i) for g in range(4) for i in range(2)}
    assert set(fakes.records) == members and all(len(fakes.finalized(r)) == 1 for r in members)
    turns = [(c.rollout_id, c.turn) for c in fakes.calls["generate_turn"]]
    assert len(turns) == len(set(turns)) == 16
    events = [e async for e in ts_env.client.get_workflow_handle(inp.run_id).fetch_history_events()]
    starts = [
        e.start_child_workflow_execution_initiated_event_attributes
        for e in events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    ]
    # group 0 admitted and group 1 held at the first decision, in one workflow task
    assert [s.workflow_id for s in starts[:2]] == [f"{inp.run_id}/{group_id(g)}" for g in range(2)]
    assert starts[0].workflow_task_completed_event_id == starts[1].workflow_task_completed_event_id
    released = [
        e for e in events if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
    ]
    assert len(released) == 3, "groups 1-3 each released once"


async def test_a_cancelled_run_cancels_its_held_group_without_a_model_call(
    own_client: Client, uid: str
) -> None:
    fakes = Fakes()
    started = asyncio.Event()

    async def held_call(g: GenerateInput) -> None:
        started.set()
        while True:
            activity.heartbeat()
            await asyncio.sleep(0.05)

    fakes.generate_hook = held_call
    inp = RunInput(
        run_id=f"run-{uid}",
        config=Config(
            run=RunConfig(num_groups=3, group_size=2, max_inflight_groups=1, prestart_groups=1),
            rollout=RolloutConfig(max_turns=3),
        ),
    )
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        await asyncio.wait_for(started.wait(), 10)
        held = own_client.get_workflow_handle(f"{inp.run_id}/{group_id(1)}")
        await wait_for_started(held)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    ran = {c.rollout_id for c in fakes.calls["generate_turn"]}
    assert ran == {rollout_id(inp.run_id, group_id(0), i) for i in range(2)}, "the held group never ran"
    members = {rollout_id(inp.run_id, group_id(g), i) for g in range(2) for i in range(2)}
    assert set(fakes.records) == members and all(len(fakes.finalized(r)) == 1 for r in members)
    assert {(r.outcome, r.reason) for r in fakes.records.values()} == {(Outcome.CANCELLED, RUN_CANCEL_REASON)}
    assert sorted(fakes.groups) == [group_id(0), group_id(1)]


async def wait_for_started(handle: WorkflowHandle) -> None:
    """Until the workflow exists (a held group is started with the first decision, soon after)."""
    for _ in range(200):
        try:
            await handle.describe()
            return
        except RPCError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{handle.id} never started")
