"""The run notices by itself a group that closed without reporting (workflows/closed_groups.py), on the test
server with fake activities (the Temporal side, describes, is the real code: activities/closed_groups.py):

- a group carried over a continue-as-new and then terminated from outside (the RPC the web UI and
  ``temporal workflow terminate`` send) is found by the run's check and accounted: its members recorded
  failed (``infra: WorkflowTerminated: group terminated (web UI or CLI)``), its record written, the run
  finishing; ``rollouts status`` (the ``progress`` query) names it while it is being accounted for; the
  ``group_terminated`` signal ``rollouts terminate`` sends afterwards changes nothing;
- a group that fails within the segment that started it is noticed by its child handle.

Each run's histories then replay against the current code. (A group terminated within its segment is
noticed by its handle on a real server, tests/integration/test_closed_groups.py: the test server never
reports a child's termination to its parent, temporalio/sdk-java#2921.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from durable_rollouts.config.models import AdmissionSection, Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.activity_io import (
    FinalizeRolloutInput,
    GenerateInput,
    StoredOutcome,
    TerminatedGroup,
    TerminatedGroupInput,
)
from durable_rollouts.contracts.types import Outcome, RunInput, RunProgress, group_id, rollout_id
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import WORKFLOWS, Fakes, fake_worker, wait_for

TERMINATED = "infra: WorkflowTerminated: group terminated (web UI or CLI)"
BOUND_S = 60.0
"""The run must end within this (real) time once its groups can end; before the fix it never did."""


def group_of(rid: str) -> str:
    return rid.split("/")[1]


async def segments(client: Client, handle: WorkflowHandle) -> list[str]:
    """The run ids of the run's continue-as-new chain, oldest first."""
    out, run_id = [], handle.first_execution_run_id
    while run_id is not None:
        out.append(run_id)
        history = await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
        last = history.events[-1]
        run_id = None
        if last.HasField("workflow_execution_continued_as_new_event_attributes"):
            run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return out


async def assert_replays(client: Client, handle: WorkflowHandle) -> None:
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    for run_id in await segments(client, handle):
        history = await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
        await replayer.replay_workflow(history)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
async def test_a_group_terminated_after_a_continue_as_new_is_accounted_by_the_run(
    own_env: WorkflowEnvironment, uid: str, adaptive: bool
) -> None:
    """Two groups in flight (a fixed cap, or adaptive admission at 4 rollouts), a segment of 2 groups: g0
    and g1 start, the run continues as new carrying them, g1 ends and g2 starts; g0, whose members hold
    their model call, is terminated from outside. The run checks every ``run.closed_group_check_s`` (fixed)
    or every poll (adaptive)."""
    own_client = own_env.client
    fakes = Fakes()
    fakes.clock = own_env.get_current_time
    held = {group_id(0), group_id(2)}
    """g0's members hold until the worker stops (the test server does not terminate a terminated group's
    members, a real one does); g2's until released."""

    async def hold(inp: GenerateInput) -> Any:
        while group_of(inp.rollout_id) in held:
            activity.heartbeat()
            await asyncio.sleep(0.05)
        return None

    fakes.generate_hook = hold
    gate = asyncio.Event()
    real_read = fakes.terminated_group

    @activity.defn(name="terminated_group")
    async def gated_read(inp: TerminatedGroupInput) -> TerminatedGroup:
        await gate.wait()  # the test looks at the run's progress meanwhile
        return await real_read(inp)

    fakes.terminated_group = gated_read  # type: ignore[method-assign]
    cfg = Config(
        run=RunConfig(
            num_groups=3, group_size=2, max_inflight_groups=2, groups_per_run_segment=2,
            closed_group_check_s=1.0,
        ),
        rollout=RolloutConfig(max_turns=3),
        admission=AdmissionSection(
            enabled=adaptive, initial_cap=4, max_inflight=4, admit_window_s=0.0, poll_interval_s=1.0
        ),
    )  # fmt: skip
    inp = RunInput(run_id=f"run-{uid}", config=cfg)
    g0 = f"{inp.run_id}/{group_id(0)}"
    members = [rollout_id(inp.run_id, group_id(0), i) for i in range(2)]
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        started = lambda: {g.rollout_id for g in fakes.calls["generate_turn"]}  # noqa: E731
        await wait_for(lambda: set(members) <= started(), what="g0's members running")
        await wait_for(lambda: group_id(2) in {group_of(r) for r in started()}, what="g2 started")
        assert len(await segments(own_client, handle)) == 2, "g0 was carried over a continue-as-new"

        await own_client.get_workflow_handle(g0).terminate(reason="as from the web UI")

        async def accounting() -> dict[str, str]:
            p: RunProgress = await handle.query(RunWorkflow.progress)
            return p.accounting

        deadline = time.monotonic() + BOUND_S
        while not (shown := await accounting()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert shown == {group_id(0): TERMINATED}, "rollouts status names the group and why"
        gate.set()
        await wait_for(lambda: group_id(0) in fakes.groups, BOUND_S, "g0 accounted")
        # `rollouts terminate g0` now: its signal finds the group accounted for and changes nothing
        ask = TerminatedGroupInput(run_id=inp.run_id, group_id=group_id(0), members=members)
        await handle.signal(RunWorkflow.group_terminated, ask)
        held.discard(group_id(2))
        result: RunProgress = await asyncio.wait_for(handle.result(), BOUND_S)
        await assert_replays(own_client, handle)

    every = {rollout_id(inp.run_id, group_id(g), i) for g in range(3) for i in range(2)}
    assert set(fakes.records) == every
    assert all(len(fakes.finalized(r)) == 1 for r in every), "one record per rollout"
    for rid in members:
        assert (fakes.records[rid].outcome, fakes.records[rid].reason) == (Outcome.FAILED, TERMINATED)
    assert len([g for g in fakes.calls["finalize_group"] if g.record.group_id == group_id(0)]) == 1
    record = fakes.groups[group_id(0)].record
    assert (record.size, record.failed, record.infra_failures) == (2, 2, {"WorkflowTerminated": 2})
    assert result.done and result.groups_done == 3 and result.accounting == {}
    assert result.outcomes == {"failed": 2, "completed": 4}
    assert fakes.calls["closed_groups"], "found by the check of carried groups"
    [accounted] = fakes.calls["terminated_group"]
    assert accounted.size == 2 and accounted.reason == "web UI or CLI"


async def test_a_group_that_fails_is_noticed_by_its_handle_and_accounted(
    own_client: Client, uid: str
) -> None:
    """g0's member 1 cannot write its record, nor can its group for it: the group fails (within the
    segment that started it, no continue-as-new). The run records that member failed and closes g0."""
    fakes = Fakes()
    dying = rollout_id(f"run-{uid}", group_id(0), 1)
    real_finalize = fakes.finalize_rollout

    @activity.defn(name="finalize_rollout")
    async def refuse_but_to_the_run(inp: FinalizeRolloutInput) -> StoredOutcome:
        if inp.rollout_id == dying and activity.info().workflow_type != "RunWorkflow":
            fakes.calls["refused"].append(activity.info().workflow_type)
            raise ApplicationError("store gone", type="StoreError", non_retryable=True)
        return await real_finalize(inp)

    fakes.finalize_rollout = refuse_but_to_the_run  # type: ignore[method-assign]
    cfg = Config(
        run=RunConfig(num_groups=2, group_size=2, max_inflight_groups=2, closed_group_check_s=3600.0),
        rollout=RolloutConfig(max_turns=3),
    )
    inp = RunInput(run_id=f"run-{uid}", config=cfg)
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result: RunProgress = await asyncio.wait_for(handle.result(), BOUND_S)
        await assert_replays(own_client, handle)

    assert set(fakes.calls["refused"]) == {"RolloutWorkflow", "GroupWorkflow"}
    every = {rollout_id(inp.run_id, group_id(g), i) for g in range(2) for i in range(2)}
    assert set(fakes.records) == every
    assert (fakes.records[dying].outcome, fakes.records[dying].reason) == (
        Outcome.FAILED,
        "infra: WorkflowFailed: group failed",
    )
    assert result.done and result.groups_done == 2 and result.outcomes == {"completed": 3, "failed": 1}
    assert fakes.groups[group_id(0)].record.size == 2
    assert not fakes.calls["closed_groups"], "no check: nothing was carried over a continue-as-new"
