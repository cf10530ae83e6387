"""Durability: a SIGKILLed worker loses no rollout and duplicates none; history stays small per turn."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.faults.proxy import Fault, FaultProxy
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from tests.conftest import Engine
from tests.integration.support import export, make_config, run_to_end, start_run, worker


def spawn_worker(env: WorkflowEnvironment, task_queue: str, home: Path, name: str) -> int:
    address = env.client.service_client.config.target_host
    return procs.spawn(name, procs.worker_argv(address, task_queue), home, env={"ROLLOUTS_HOME": str(home)})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["activities", "local-model-calls", "inline-rollouts"])
async def test_sigkill_worker_mid_run_loses_and_duplicates_nothing(
    temporal_env: WorkflowEnvironment,
    client: Client,
    engine: Engine,
    task_queue: str,
    tmp_path: Path,
    ledger: Any,
    fault_proxy: Callable[[str], Awaitable[FaultProxy]],
    mode: str,
) -> None:
    """Model calls as activities, as local activities (the main job's config), and rollouts run inside
    their group's workflow (``group.inline_rollouts``): a local call the killed worker held runs again on
    the next worker once its workflow task times out. The engine sits behind a fault proxy that holds
    the model calls made at the kill (``hang``), so the kill always lands while the worker holds one: a
    local call inside a workflow task, an activity otherwise (not a moment between calls, by chance)."""
    groups, size = 24, 4
    local, inline = mode != "activities", mode == "inline-rollouts"
    proxy = await fault_proxy(engine.url)
    cfg = make_config(
        [proxy.url],
        task_queue,
        run={"num_groups": groups, "group_size": size, "max_inflight_groups": 3},
        rollout={"local_model_calls": local},
        group={"inline_rollouts": inline},
    )
    run_id = f"sigkill-{mode}"
    store = RunStore(tmp_path)
    first = spawn_worker(temporal_env, task_queue, tmp_path, "worker-1")
    second = None
    try:
        handle = await start_run(client, cfg, run_id)
        for _ in range(1200):
            if sum(store.count_rollouts(run_id).values()) >= 8:
                break
            await asyncio.sleep(0.05)
        proxy.set(Fault.HANG)  # calls made from now on are held: wait until the worker holds one
        for _ in range(400):
            if proxy.hits:
                break
            await asyncio.sleep(0.025)
        assert proxy.hits, "no model call reached the engine within 10 s of the hang"
        os.killpg(first, signal.SIGKILL)
        proxy.clear()
        done_at_kill = sum(store.count_rollouts(run_id).values())
        assert 8 <= done_at_kill < groups * size, "the kill must land while rollouts are in flight"
        second = spawn_worker(temporal_env, task_queue, tmp_path, "worker-2")
        result = await asyncio.wait_for(handle.result(), timeout=400)
    finally:
        procs.stop_pid(first)
        if second is not None:
            procs.stop_pid(second)
    assert result.done and sum(result.outcomes.values()) == groups * size
    rollouts, group_records = export(store, run_id)
    expected = {rollout_id(run_id, group_id(g), i) for g in range(groups) for i in range(size)}
    assert sorted(r["rollout_id"] for r in rollouts) == sorted(expected)  # each exactly once
    assert len(group_records) == groups
    assert all(r["outcome"] == "completed" for r in rollouts)
    await ledger(store, run_id, client=client)
    if local:  # the kill caught rollouts inside a workflow task (where a local call runs): it timed out
        # (inline: the members' workflow tasks are their groups'; no member has a workflow of its own)
        ids = sorted({f"{run_id}/{group_id(g)}" for g in range(groups)} if inline else expected)
        caught = [
            wid
            for wid in ids
            if EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
            in [e.event_type async for e in client.get_workflow_handle(wid).fetch_history_events()]
        ]
        assert caught, "no rollout was inside a workflow task at the kill"
    if inline:
        types = [
            e.event_type
            async for e in client.get_workflow_handle(f"{run_id}/{group_id(0)}").fetch_history_events()
        ]
        assert EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED not in types


def _history_bytes(events) -> int:
    return sum(e.ByteSize() for e in events)


@pytest.mark.timeout(600)
async def test_history_bytes_per_turn_stay_under_2kb(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    tasks = tmp_path / "never.jsonl"  # an answer the policy never gives: every attempt is wrong
    tasks.write_text(json.dumps({"id": "never", "prompt": "12+34=", "answer": "never"}) + "\n")
    sizes = {}
    async with worker(client, task_queue, tmp_path / "store"):
        for turns in (1, 9):
            cfg = make_config(
                [engine.url],
                task_queue,
                run={"num_groups": 1, "group_size": 1, "task_file": str(tasks)},
                rollout={"max_turns": turns, "max_total_tokens": 4096},
            )
            await run_to_end(client, cfg, f"history-{turns}")
            history = await client.get_workflow_handle(
                rollout_id(f"history-{turns}", group_id(0), 0)
            ).fetch_history()
            sizes[turns] = _history_bytes(history.events)
            if turns == 9:
                by_type: dict[str, int] = {}
                for e in history.events:
                    name = e.WhichOneof("attributes") or "?"
                    by_type[name] = by_type.get(name, 0) + e.ByteSize()
                print(sorted(by_type.items(), key=lambda kv: -kv[1]))
    per_turn = (sizes[9] - sizes[1]) / 8
    print(f"history bytes: 1 turn {sizes[1]}, 9 turns {sizes[9]}, marginal {per_turn:.0f} B/turn")
    assert sizes[9] > sizes[1]
    assert per_turn < 2048
    assert sizes[9] / 9 < 2048 * 2  # fixed start/finish overhead amortises quickly
