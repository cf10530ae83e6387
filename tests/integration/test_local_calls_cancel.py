"""Rollouts whose model calls are local activities (``rollout.local_model_calls``), cancelled by signal at
random moments around their call: every one gets exactly one record, and every rollout's history replays.
The SDK regroups local-activity resolutions on replay (temporalio 1.32-1.35), which broke the run
workflow's replay when a signal and a resolution met in one activation (docs/measurements/cost.md); this is
the rollout's side of that risk. Real Temporal dev server, simulated engine with 50-400 ms calls."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import Replayer

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.workers.worker import WORKFLOWS
from durable_rollouts.workflows.group import GroupWorkflow
from durable_rollouts.workflows.rollout import RolloutWorkflow
from tests.integration.support import export, make_config, run_to_end, worker

GROUPS, SIZE = 24, 4
SETTINGS = SimSettings(policy="random", random_min_tokens=5, random_max_tokens=40, decode_ms_per_token=10)


async def at_random(
    client: Client, wid: str, rng: random.Random, send: Callable[[WorkflowHandle], Awaitable[None]]
) -> None:
    """Once workflow ``wid`` exists, wait 0-0.5 s and ``send`` it a signal; a closed one refuses it."""
    handle = client.get_workflow_handle(wid)
    for _ in range(600):
        try:
            await handle.describe()
            break
        except RPCError:
            await asyncio.sleep(0.05)
    await asyncio.sleep(rng.uniform(0.0, 0.5))
    with contextlib.suppress(RPCError):  # already closed
        await send(handle)


async def cancelled_run(
    client: Client, task_queue: str, tmp_path: Path, run_id: str, seed: int, inline: bool
) -> tuple[Any, list[dict], list[dict], list[str]]:
    """A 1-turn run with local model calls whose every rollout is cancelled at a random moment: by
    ``cancel_for`` to its workflow, or (``inline``: members inside their group's workflow) by
    ``cancel_member`` to its group. Its result, records, group records and rollout ids."""
    rng = random.Random(seed)
    ids = [rollout_id(run_id, group_id(g), i) for g in range(GROUPS) for i in range(SIZE)]

    def cancel(rid: str) -> Callable[[WorkflowHandle], Awaitable[None]]:
        if inline:
            return lambda group: group.signal(GroupWorkflow.cancel_member, args=[rid, "manual"])
        return lambda rollout: rollout.signal(RolloutWorkflow.cancel_for, "manual")

    async with SimEngine(SETTINGS).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": GROUPS, "group_size": SIZE, "max_inflight_groups": 8},
            rollout={"max_turns": 1, "local_model_calls": True},
            group={"inline_rollouts": inline},
            sampling={"max_tokens": 40},
        )
        async with worker(client, task_queue, tmp_path, sandboxed=False) as store:
            targets = [(rid.rsplit("/", 1)[0] if inline else rid, rid) for rid in ids]
            signals = asyncio.gather(*(at_random(client, wid, rng, cancel(rid)) for wid, rid in targets))
            result = await run_to_end(client, cfg, run_id)
            await signals
            rollouts, groups = export(store, run_id)
    assert result.done and sum(result.outcomes.values()) == GROUPS * SIZE, result.outcomes
    assert sorted(r["rollout_id"] for r in rollouts) == sorted(ids), "one record per rollout"
    assert len(groups) == GROUPS
    assert {r["outcome"] for r in rollouts} <= {"completed", "cancelled"}, result.outcomes
    return result, rollouts, groups, ids


@pytest.mark.timeout(300)
async def test_cancels_that_meet_a_local_model_call_leave_one_record_and_a_history_that_replays(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    result, rollouts, _, ids = await cancelled_run(client, task_queue, tmp_path, "local-cancel", 7, False)
    # the signals landed on both sides of the calls' ends: some rollouts cancelled, some completed
    assert len({r["outcome"] for r in rollouts}) == 2, result.outcomes
    for r in rollouts:
        if r["outcome"] == "cancelled":
            assert r["reason"] == "manual", r
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    for rid in ids:
        history = await client.get_workflow_handle(rid).fetch_history()
        await replayer.replay_workflow(history)  # raises on a nondeterminism error


@pytest.mark.timeout(300)
async def test_cancels_of_inline_members_leave_one_record_and_group_histories_that_replay(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    """The same with ``group.inline_rollouts``: the members' calls are local activities of their group's
    workflow task, and the cancels are signals to the group arriving while those calls run. A group's task
    stays open until its running calls end (the SDK heartbeats it every ~8 s), so with calls this short a
    cancel reaches its group after the member has ended, and the member's outcome stands."""
    await cancelled_run(client, task_queue, tmp_path, "inline-cancel", 11, True)
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    signalled = 0
    for g in range(GROUPS):
        history = await client.get_workflow_handle(f"inline-cancel/{group_id(g)}").fetch_history()
        types = [e.event_type for e in history.events]
        assert EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED not in types
        signalled += types.count(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
        await replayer.replay_workflow(history)  # raises on a nondeterminism error
    assert signalled > 0, "no cancel reached a running group: the test exercised nothing"
