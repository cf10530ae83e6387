"""A run cancelled as a whole (``rollouts cancel RUN``, or the RunWorkflow's handle ``cancel``): every
in-flight rollout ends with a record (cancelled, ``run-cancelled``), every started group closes with its
full size, no group starts after the cancel, sandboxes are destroyed, the run's status says cancelled
(Temporal and the store), and the ledger is clean."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import CancelledError

from durable_rollouts.cli import ops
from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.faults import LedgerReport
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.store import RunStore
from durable_rollouts.workflows.group import RUN_CANCEL_REASON
from durable_rollouts.workflows.run import RunWorkflow
from tests.integration.support import (
    CODING_TASKS,
    assert_no_containers,
    coding_config,
    export,
    make_config,
    start_run,
    wait_for_first_command,
    worker,
)


async def _cancel_and_wait(client: Client, run_id: str, store: RunStore | None = None) -> None:
    """Cancel the run: with a store, as ``rollouts cancel RUN`` does (``cli.ops.cancel``), else by its
    workflow handle; then it ends CANCELED."""
    handle = client.get_workflow_handle(run_id)
    if store is not None:
        said = await ops.cancel(client, store, run_id)
        assert said.startswith(f"cancelled run {run_id} (CANCELED): records "), said
        assert [a["action"] for a in store.manual_actions(run_id)] == ["cancel"]
    else:
        await handle.cancel()
    with pytest.raises(WorkflowFailureError) as err:
        await asyncio.wait_for(handle.result(), 120)
    assert isinstance(err.value.cause, CancelledError)
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED


def _assert_closed_as_cancelled(store: RunStore, run_id: str, size: int) -> tuple[list[dict], list[dict]]:
    run = store.get_run(run_id)
    assert run is not None and run["status"] == "cancelled"
    rollouts, groups = export(store, run_id)
    assert groups and all(g["size"] == size for g in groups)
    started = {g["group_id"] for g in groups}
    assert {r["group_id"] for r in rollouts} == started
    assert len(rollouts) == len(started) * size  # one record per slot of every started group
    assert len({r["rollout_id"] for r in rollouts}) == len(rollouts)
    for r in rollouts:
        assert r["outcome"] in ("completed", "cancelled"), (r["rollout_id"], r["outcome"], r["reason"])
        if r["outcome"] == "cancelled":
            assert r["reason"] == RUN_CANCEL_REASON and r["reward"] is None and not r["scorable"]
    return rollouts, groups


@pytest.mark.timeout(180)
async def test_a_cancelled_math_run_records_its_in_flight_rollouts_and_starts_no_more_groups(
    client: Client, ledger: Callable[..., Awaitable[LedgerReport]], task_queue: str, tmp_path: Path
) -> None:
    """Six groups of two, two in flight at a time, turns of about two seconds: cancelled while the first
    model calls run, so two groups are in flight and four never start."""
    sim = SimSettings(policy="random", random_min_tokens=8, random_max_tokens=8, decode_ms_per_token=250)
    run_id = "cancel-math"
    async with SimEngine(sim).serve(port=0) as url:
        cfg = make_config(
            [url], task_queue,
            run={"num_groups": 6, "group_size": 2, "max_inflight_groups": 2},
            rollout={"max_turns": 1},
        )  # fmt: skip
        async with worker(client, task_queue, tmp_path) as store:
            await start_run(client, cfg, run_id)
            await _wait_for_inflight(store, client, run_id, 2)
            await _cancel_and_wait(client, run_id, store)  # `rollouts cancel RUN`
            await ledger(store, run_id, client=client)
            rollouts, groups = _assert_closed_as_cancelled(store, run_id, 2)
    assert len(groups) == 2  # the groups never started have no record
    assert sum(r["outcome"] == "cancelled" for r in rollouts) >= 3  # at most one call ended in between


@pytest.mark.timeout(180)
async def test_a_cancelled_coding_run_destroys_its_sandboxes(
    client: Client,
    docker: DockerBackend,
    ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str,
    tmp_path: Path,
) -> None:
    """A coding rollout cancelled while its sandbox runs a long command (`sleep 30`)."""
    rules = [ModeRule(on="request", prefix="sleep-", mode=Mode.SLEEP)]
    sim = SimSettings(tasks=CODING_TASKS, mode=Mode.LOOP, mode_rules=rules, max_model_len=32768)
    run_id = "sleep-run-cancel"  # unique on the session server: the ledger lists workflows by run id
    rid = rollout_id(run_id, group_id(0), 0)
    async with SimEngine(sim).serve(port=0) as url:
        cfg = coding_config(url, task_queue, groups=3, size=1, rollout={"max_turns": 2})
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"max_inflight_groups": 1})})
        async with worker(client, task_queue, tmp_path) as store:
            await start_run(client, cfg, run_id)
            await wait_for_first_command(store, rid)
            await asyncio.sleep(1.0)  # the command is running in the sandbox
            assert len(docker.list_containers(run_id)) == 1
            await _cancel_and_wait(client, run_id)
            await ledger(store, run_id, client=client, backend=docker)
            rollouts, groups = _assert_closed_as_cancelled(store, run_id, 1)
    assert_no_containers(docker, run_id)
    assert [(r["rollout_id"], r["outcome"]) for r in rollouts] == [(rid, "cancelled")]
    assert len(groups) == 1


async def _wait_for_inflight(store: RunStore, client: Client, run_id: str, groups: int) -> None:
    """Until ``groups`` groups are in flight and every member's prompt is stored (its model call runs)."""
    for _ in range(600):
        prog = await client.get_workflow_handle(run_id).query(RunWorkflow.progress)
        ids = [rollout_id(run_id, group_id(g), i) for g in range(groups) for i in range(2)]
        if prog.groups_inflight >= groups and all(store.get_segment(r, "prompt") for r in ids):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id}: {groups} groups never in flight with their model calls running")
