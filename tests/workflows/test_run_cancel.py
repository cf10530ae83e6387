"""A run cancelled as a whole, on the test server with fake activities: its in-flight groups cancel their
members (each recorded once, cancelled, reason run-cancelled), close with their full size and report;
no group starts after the cancel; the store is told the run was cancelled; the run ends cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import CancelledError

from durable_rollouts.config.models import Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.activity_io import GenerateInput
from durable_rollouts.contracts.types import Outcome, RunInput, group_id, rollout_id
from durable_rollouts.workflows.group import RUN_CANCEL_REASON
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import Fakes, fake_worker, wait_for


async def _held(_: GenerateInput) -> Any:
    """A model call that never ends by itself: heartbeats until it is cancelled."""
    while True:
        activity.heartbeat()
        await asyncio.sleep(0.05)


async def test_a_cancelled_run_cancels_its_groups_members_and_starts_no_more(
    own_client: Client, uid: str
) -> None:
    fakes = Fakes()
    fakes.generate_hook = _held
    cfg = Config(
        run=RunConfig(num_groups=5, group_size=2, max_inflight_groups=2), rollout=RolloutConfig(max_turns=3)
    )
    inp = RunInput(run_id=f"run-{uid}", config=cfg)
    tq = f"tq-{uid}"
    async with fake_worker(own_client, tq, fakes):
        handle = await own_client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        await wait_for(lambda: len(fakes.calls["generate_turn"]) >= 4, what="4 model calls running")
        await handle.cancel()
        with pytest.raises(WorkflowFailureError) as err:
            await handle.result()
    assert isinstance(err.value.cause, CancelledError)
    members = {rollout_id(inp.run_id, group_id(g), i) for g in range(2) for i in range(2)}
    assert set(fakes.records) == members  # the two groups in flight, nothing of the three never started
    assert all(len(fakes.finalized(rid)) == 1 for rid in members)
    assert {(r.outcome, r.reason) for r in fakes.records.values()} == {(Outcome.CANCELLED, RUN_CANCEL_REASON)}
    assert sorted(fakes.groups) == [group_id(0), group_id(1)]
    assert all(g.record.size == 2 and g.record.scorable == 0 for g in fakes.groups.values())
    assert {g.rollout_id for g in fakes.calls["generate_turn"]} == members
    assert fakes.calls["finish_run_status"] == ["cancelled"]
