"""Coding rollouts under faults and at length: a worker SIGKILLed mid-command, a 300-turn rollout."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from tests.integration.support import (
    CODING_TASKS,
    assert_no_containers,
    coding_config,
    export,
    run_to_end,
    start_run,
    wait_for_first_command,
    worker,
)
from tests.integration.test_durability import spawn_worker


@pytest.fixture(scope="module")
async def long_sim() -> AsyncIterator[str]:
    # the SIGKILL test's second member solves its task (the ledger wants a success), the rest sleep or loop
    solved = ModeRule(on="request", prefix=f"sleep-sigkill/{group_id(0)}/1", mode=Mode.REFERENCE)
    rules = [solved, ModeRule(on="request", prefix="sleep-", mode=Mode.SLEEP)]
    settings = SimSettings(tasks=CODING_TASKS, mode=Mode.LOOP, mode_rules=rules, max_model_len=32768)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


@pytest.mark.timeout(600)
async def test_worker_sigkill_during_a_sandbox_command(
    temporal_env: WorkflowEnvironment,
    client: Client,
    docker: DockerBackend,
    long_sim: str,
    task_queue: str,
    tmp_path: Path,
    ledger: Any,
) -> None:
    run_id = "sleep-sigkill"
    rid = rollout_id(run_id, group_id(0), 0)
    cfg = coding_config(
        long_sim, task_queue, groups=1, size=2, rollout={"max_turns": 4}, sandbox={"command_timeout_s": 8}
    )
    store = RunStore(tmp_path)
    first = spawn_worker(temporal_env, task_queue, tmp_path, "worker-1")
    second = None
    try:
        handle = await start_run(client, cfg, run_id)
        await wait_for_first_command(store, rid)
        await asyncio.sleep(1.0)  # the first `sleep 30` is running in the sandbox
        os.killpg(first, signal.SIGKILL)
        assert rid in [i.key for i in docker.list_containers(run_id)]
        second = spawn_worker(temporal_env, task_queue, tmp_path, "worker-2")
        await asyncio.wait_for(handle.result(), timeout=300)
    finally:
        procs.stop_pid(first)
        if second is not None:
            procs.stop_pid(second)
    await ledger(store, run_id, client=client, backend=docker, pool=SandboxPool(store))
    rollouts, (group,) = export(store, run_id)
    rec = next(r for r in rollouts if r["rollout_id"] == rid)
    assert group["size"] == 2 and len(rollouts) == 2
    assert (rec["outcome"], rec["reason"]) == ("truncated", "command_timeout")
    assert_no_containers(docker, run_id)


@pytest.mark.timeout(900)
async def test_a_300_turn_rollout_continues_as_new_and_completes(
    client: Client,
    docker: DockerBackend,
    long_sim: str,
    task_queue: str,
    tmp_path: Path,
) -> None:
    run_id = "loop-300"
    cfg = coding_config(
        long_sim,
        task_queue,
        groups=1,
        size=1,
        sampling={"max_tokens": 256},
        rollout={"max_turns": 300, "max_total_tokens": 32000, "timeout_s": 3000},
    )
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, run_id)
    (rec,), _ = export(store, run_id)
    assert (rec["outcome"], rec["reason"]) == ("truncated", "max_turns")
    assert len(rec["turns"]) == 300
    runs = [w async for w in client.list_workflows(f'WorkflowId = "{rollout_id(run_id, group_id(0), 0)}"')]
    assert len(runs) >= 2, "the rollout should have continued as new"
    for w in runs:
        desc = await client.get_workflow_handle(w.id, run_id=w.run_id).describe()
        assert desc.history_length < 10_240  # the server's history-size warning threshold
    assert_no_containers(docker, run_id)
