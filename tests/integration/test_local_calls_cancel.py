"""Rollouts whose model calls are local activities (``rollout.local_model_calls``, on in the main job's
config), cancelled by signal at random moments around their call: every one gets exactly one record,
and every rollout's history replays. The SDK regroups local-activity resolutions on replay
(temporalio 1.32-1.35), which broke the run workflow's replay when a signal and a resolution met in one
activation (docs/measurements/cost.md); this is the rollout's side of that risk. Real Temporal dev server,
simulated engine with 50-400 ms calls."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import Replayer

from contracts.types import group_id, rollout_id
from simengine import SimEngine, SimSettings
from tests.integration.support import export, make_config, run_to_end, worker
from workers.worker import WORKFLOWS
from workflows.rollout import RolloutWorkflow

GROUPS, SIZE = 24, 4


async def cancel_at_random(client: Client, rid: str, rng: random.Random) -> None:
    """Once the rollout's workflow exists, wait 0-0.5 s and signal ``cancel_for``; a rollout that
    already ended refuses the signal."""
    handle = client.get_workflow_handle(rid)
    for _ in range(600):
        try:
            await handle.describe()
            break
        except RPCError:
            await asyncio.sleep(0.05)
    await asyncio.sleep(rng.uniform(0.0, 0.5))
    with contextlib.suppress(RPCError):  # already closed
        await handle.signal(RolloutWorkflow.cancel_for, "manual")


@pytest.mark.timeout(300)
async def test_cancels_that_meet_a_local_model_call_leave_one_record_and_a_history_that_replays(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    settings = SimSettings(policy="random", random_min_tokens=5, random_max_tokens=40, decode_ms_per_token=10)
    rng = random.Random(7)
    run_id = "local-cancel"
    ids = [rollout_id(run_id, group_id(g), i) for g in range(GROUPS) for i in range(SIZE)]
    async with SimEngine(settings).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": GROUPS, "group_size": SIZE, "max_inflight_groups": 8},
            rollout={"max_turns": 1, "local_model_calls": True},
            sampling={"max_tokens": 40},
        )
        async with worker(client, task_queue, tmp_path, sandboxed=False) as store:
            signals = asyncio.gather(*(cancel_at_random(client, rid, rng) for rid in ids))
            result = await run_to_end(client, cfg, run_id)
            await signals
            rollouts, groups = export(store, run_id)
    assert result.done and sum(result.outcomes.values()) == GROUPS * SIZE, result.outcomes
    assert sorted(r["rollout_id"] for r in rollouts) == sorted(ids), "one record per rollout"
    assert len(groups) == GROUPS
    outcomes = {r["outcome"] for r in rollouts}
    # the signals landed on both sides of the calls' ends: some rollouts cancelled, some completed
    assert outcomes <= {"completed", "cancelled"} and len(outcomes) == 2, result.outcomes
    for r in rollouts:
        if r["outcome"] == "cancelled":
            assert r["reason"] == "manual", r
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    for rid in ids:
        history = await client.get_workflow_handle(rid).fetch_history()
        await replayer.replay_workflow(history)  # raises on a nondeterminism error
