"""Partial rollouts: a rollout pauses after its per-step token budget and continues under the next
published policy version; its record keeps every token's version. Simulated engine (random policy, whose
weight version is set over HTTP) and the real Temporal dev server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client
from temporalio.service import RPCError

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workflows.rollout import RolloutWorkflow
from tests.integration.support import export, make_config, start_run, worker


async def publish(store: RunStore, url: str, version: str) -> None:
    """What `rollouts policy publish` leaves behind, minus the weights: the engine's label and the row."""
    async with httpx.AsyncClient(timeout=10) as http:  # the engine serves on this event loop
        (await http.post(f"{url}/update_weight_version", json={"new_version": version})).raise_for_status()
    store.put_policy(version, f"hash-{version}", f"/weights/{version}", [url])
    store.finish_policy(version, [url])


async def all_paused(client: Client, rids: list[str], turn: int) -> None:
    states: list[dict] = []
    for _ in range(300):
        await asyncio.sleep(0.1)
        try:
            states = [await client.get_workflow_handle(r).query(RolloutWorkflow.state) for r in rids]
        except RPCError:  # not started yet
            continue
        if all(s["phase"] == "paused" and s["turn"] == turn for s in states):
            return
    raise AssertionError(f"rollouts never all paused after turn {turn}: {states}")


@pytest.mark.timeout(300)
async def test_a_partial_rollout_continues_under_each_new_version_and_keeps_per_token_versions(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    settings = SimSettings(policy="random", random_min_tokens=6, random_max_tokens=6)
    async with SimEngine(settings).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": 1, "group_size": 2},
            rollout={"max_turns": 3, "step_token_budget": 4, "partial_poll_s": 0.2},
            sampling={"max_tokens": 16},
        )
        rids = [rollout_id("partial", group_id(0), i) for i in range(2)]
        async with worker(client, task_queue, tmp_path) as store:
            await publish(store, url, "v0")
            handle = await start_run(client, cfg, "partial")
            await all_paused(client, rids, turn=1)  # one turn (7 tokens) is over the budget of 4
            await publish(store, url, "v1")
            await all_paused(client, rids, turn=2)
            await publish(store, url, "v2")
            result = await handle.result()
    assert result.done
    rollouts, _ = export(store, "partial")
    assert len(rollouts) == 2
    for rec in rollouts:
        assert rec["outcome"] == "completed" and len(rec["turns"]) == 3  # random answers: all 3 turns
        assert rec["partial_steps"] == 2
        versions = rec["policy_versions"]  # one per token of the rollout (None outside model turns)
        by_turn = [set(versions[t["range"][0] : t["range"][1]]) for t in rec["turns"]]
        assert by_turn == [{"v0"}, {"v1"}, {"v2"}]
        assert rec["lineage"]["policy_versions"] == ["v0", "v1", "v2"]
