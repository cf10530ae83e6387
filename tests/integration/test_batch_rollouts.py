"""Rollouts run in batches (``group.batch_rollouts``): each group's members run together inside one
activity. Every rollout ends once with its record; a worker SIGKILLed mid-batch leaves one record per
rollout and no stored turn sampled again (the engine's requests counted); a run cancelled mid-batch
records its in-flight members cancelled. Real Temporal dev server, simulated engine playing scripted math
transcripts (``turns - 1`` wrong answers, each answered by the environment's retry observation, then the
right one), counting every request that reaches it by id (``<rollout>/<turn>/<attempt>``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.cli import ops
from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.faults.proxy import Fault, FaultProxy
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store import RunStore
from durable_rollouts.workflows.group import RUN_CANCEL_REASON
from tests.integration.support import TASKS, export, make_config, start_run, worker


def scripted(home: Path, turns: int, **settings: Any) -> tuple[SimEngine, Path]:
    """The engine playing every math task in ``turns`` turns, and the task file naming each task's id."""
    tasks, scripts = [], []
    for line in TASKS.read_text().splitlines():
        t = json.loads(line)
        tasks.append({**t, "prompt": f"Task id: {t['id']}\n{t['prompt']}"})
        scripts.append(
            {"task_id": t["id"], "mode": "reference", "turns": ["wrong"] * (turns - 1) + [t["answer"]]}
        )
    task_file, transcripts = home / "tasks.jsonl", home / "transcripts.jsonl"
    task_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    transcripts.write_text("".join(json.dumps(s) + "\n" for s in scripts))
    return SimEngine(SimSettings(policy="scripted", transcripts=transcripts, **settings)), task_file


def counting(sim: SimEngine) -> Counter[tuple[str, int]]:
    """Requests that reach the engine's policy, by (rollout id, turn)."""
    seen: Counter[tuple[str, int]] = Counter()
    turn = sim.policy.turn

    def record(req: Any) -> Any:
        rid, t, _ = req.request_id.rsplit("/", 2)
        seen[(rid, int(t))] += 1
        return turn(req)

    sim.policy.turn = record  # type: ignore[method-assign]
    return seen


def batched_config(url: str, task_queue: str, groups: int, size: int, turns: int, tasks: Path = TASKS) -> Any:
    return make_config(
        [url],
        task_queue,
        run={"num_groups": groups, "group_size": size, "max_inflight_groups": 3, "task_file": str(tasks)},
        rollout={"max_turns": turns},
        group={"batch_rollouts": True},
    )


def stored_turns(store: RunStore, rids: list[str]) -> set[tuple[str, int]]:
    return {
        (rid, s.turn) for rid in rids for s in store.segments(rid) if s.kind == "model" and s.turn is not None
    }


async def batch_heartbeat(client: Client, wid: str) -> list[str]:
    """The heartbeat details of group ``wid``'s running batch, as the web UI shows its pending activity."""
    for _ in range(100):
        desc = await client.get_workflow_handle(wid).describe()
        for pa in desc.raw_description.pending_activities:
            if pa.activity_type.name == "run_batch" and pa.heartbeat_details.payloads:
                return json.loads(pa.heartbeat_details.payloads[0].data)
        await asyncio.sleep(0.1)
    raise AssertionError(f"{wid}: no batch with heartbeat details within 10 s")


async def group_events(client: Client, wid: str) -> list[int]:
    return [e.event_type async for e in client.get_workflow_handle(wid).fetch_history_events()]


@pytest.mark.timeout(120)
async def test_a_batched_run_ends_every_rollout_once_with_its_record(
    client: Client, task_queue: str, tmp_path: Path, ledger: Callable[..., Awaitable[Any]]
) -> None:
    groups, size, turns = 6, 4, 3
    run_id = "batched"
    ids = [rollout_id(run_id, group_id(g), i) for g in range(groups) for i in range(size)]
    sim, tasks = scripted(tmp_path, turns)
    requests = counting(sim)
    async with sim.serve(port=0) as url, worker(client, task_queue, tmp_path, sandboxed=False) as store:
        handle = await start_run(client, batched_config(url, task_queue, groups, size, turns, tasks), run_id)
        result = await asyncio.wait_for(handle.result(), 90)
        rollouts, group_records = export(store, run_id)
        turns_stored = stored_turns(store, ids)
        await ledger(store, run_id, client=client)
    assert result.done and sum(result.outcomes.values()) == groups * size, result.outcomes
    assert sorted(r["rollout_id"] for r in rollouts) == sorted(ids)  # one record each
    assert len(group_records) == groups and all(g["size"] == size for g in group_records)
    # each rollout answers right at its last turn: completed, reward 1
    assert {(r["outcome"], r["reason"], r["reward"]) for r in rollouts} == {("completed", None, 1.0)}
    assert turns_stored == {(rid, t) for rid in ids for t in range(turns)}
    assert set(requests) == turns_stored and set(requests.values()) == {1}  # each turn sampled once
    for g in range(groups):
        events = await group_events(client, f"{run_id}/{group_id(g)}")
        assert EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED not in events
        assert events.count(EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED) == 1  # the batch (records: local)


def spawn_worker(env: WorkflowEnvironment, task_queue: str, home: Path, name: str) -> int:
    address = env.client.service_client.config.target_host
    return procs.spawn(name, procs.worker_argv(address, task_queue), home, env={"ROLLOUTS_HOME": str(home)})


@pytest.mark.timeout(240)
async def test_a_worker_sigkilled_mid_batch_leaves_one_record_per_rollout_and_samples_no_stored_turn_again(
    temporal_env: WorkflowEnvironment,
    client: Client,
    task_queue: str,
    tmp_path: Path,
    ledger: Callable[..., Awaitable[Any]],
) -> None:
    """Turns of about 0.3 s, four per rollout: the kill lands while batches hold rollouts part-way
    through. The next worker retries each batch once its heartbeat times out; the turns stored before the
    kill are read back, not asked of the engine again."""
    groups, size, turns = 6, 4, 4
    run_id = "batched-kill"
    ids = [rollout_id(run_id, group_id(g), i) for g in range(groups) for i in range(size)]
    sim, tasks = scripted(tmp_path, turns, decode_ms_per_token=100)
    requests = counting(sim)
    store = RunStore(tmp_path)
    first = second = None
    async with sim.serve(port=0) as url:
        try:
            first = spawn_worker(temporal_env, task_queue, tmp_path, "worker-1")
            handle = await start_run(
                client, batched_config(url, task_queue, groups, size, turns, tasks), run_id
            )
            partial: set[str] = set()
            for _ in range(1200):  # until some rollout has turns stored and no record yet
                recorded = {r["rollout_id"] for r in store.rollouts(run_id)}
                partial = {rid for rid, t in stored_turns(store, ids) if t >= 1 and rid not in recorded}
                if partial and recorded:
                    break
                await asyncio.sleep(0.05)
            os.killpg(first, signal.SIGKILL)
            at_kill = stored_turns(store, ids)
            recorded = {r["rollout_id"] for r in store.rollouts(run_id)}
            assert partial and len(recorded) < len(ids), "the kill must land while batches are in flight"
            second = spawn_worker(temporal_env, task_queue, tmp_path, "worker-2")
            result = await asyncio.wait_for(handle.result(), 180)
        finally:
            for pid in (first, second):
                if pid is not None:
                    procs.stop_pid(pid)
    rollouts, group_records = export(store, run_id)
    assert result.done and sum(result.outcomes.values()) == groups * size, result.outcomes
    assert sorted(r["rollout_id"] for r in rollouts) == sorted(ids)  # each exactly once
    assert len(group_records) == groups
    assert {(r["outcome"], r["reason"], r["reward"]) for r in rollouts} == {("completed", None, 1.0)}
    resumed = {(rid, t) for rid, t in at_kill if rid not in recorded}
    assert resumed, "no rollout had stored turns and no record at the kill: nothing was resumed"
    again = {k: requests[k] for k in at_kill if requests[k] != 1}
    assert not again, f"turns stored before the kill were sampled again: {again}"
    attempts = [
        e.activity_task_started_event_attributes.attempt
        for g in range(groups)
        async for e in client.get_workflow_handle(f"{run_id}/{group_id(g)}").fetch_history_events()
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]
    assert max(attempts) > 1, f"no batch ran again after the kill: {attempts}"
    await ledger(store, run_id, client=client)
    store.close()


@pytest.mark.timeout(120)
async def test_a_run_cancelled_mid_batch_records_its_members_cancelled(
    client: Client, task_queue: str, tmp_path: Path, ledger: Callable[..., Awaitable[Any]]
) -> None:
    """Turns of about twenty seconds: the run is cancelled while its first batches wait on the engine; a
    batch learns of its cancel at its next heartbeat (within the SDK's throttle, 0.8 of its 10 s heartbeat
    timeout) and stops, and its group records every member cancelled."""
    run_id = "batched-cancel"
    sim = SimEngine(
        SimSettings(policy="random", random_min_tokens=8, random_max_tokens=8, decode_ms_per_token=2500)
    )
    async with sim.serve(port=0) as url, worker(client, task_queue, tmp_path, sandboxed=False) as store:
        handle = await start_run(client, batched_config(url, task_queue, 6, 2, 1), run_id)
        for _ in range(600):  # until a batch's model calls are under way
            if store.unrecorded_with_segments(f"{run_id}/"):
                break
            await asyncio.sleep(0.05)
        beat = await batch_heartbeat(client, f"{run_id}/{group_id(0)}")
        # what an operator sees of a running batch: one line per member in flight, named by id
        assert sorted(line.split(": ")[0] for line in beat) == [
            rollout_id(run_id, group_id(0), i) for i in (0, 1)
        ]
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 90)
        rollouts, groups = export(store, run_id)
        await ledger(store, run_id, client=client)
    assert groups and all(g["size"] == 2 for g in groups)
    assert len(rollouts) == 2 * len(groups) == len({r["rollout_id"] for r in rollouts})
    cancelled = [r for r in rollouts if r["outcome"] == "cancelled"]
    assert cancelled and all(r["reason"] == RUN_CANCEL_REASON and not r["scorable"] for r in cancelled)
    assert {r["outcome"] for r in rollouts} <= {"cancelled", "completed"}


@pytest.mark.timeout(150)
async def test_cancelling_one_member_stops_its_batch_and_the_others_resume_from_the_store(
    client: Client, task_queue: str, tmp_path: Path, ledger: Callable[..., Awaitable[Any]]
) -> None:
    """``rollouts cancel`` of one batched member (turns of about eight seconds, three per rollout): the
    batch stops at its next heartbeat, the member is recorded cancelled (reason ``manual``), and the
    group's next batch runs the others on from their stored turns, none asked of the engine again."""
    run_id = "batched-member-cancel"
    ids = [rollout_id(run_id, group_id(0), i) for i in range(3)]
    sim, tasks = scripted(tmp_path, 3, decode_ms_per_token=1000)
    requests = counting(sim)
    async with sim.serve(port=0) as url, worker(client, task_queue, tmp_path, sandboxed=False) as store:
        handle = await start_run(client, batched_config(url, task_queue, 1, 3, 3, tasks), run_id)
        for _ in range(1200):  # until the first turns are stored
            if (ids[0], 0) in stored_turns(store, ids):
                break
            await asyncio.sleep(0.05)
        said = await ops.cancel(client, store, ids[0])
        assert said.startswith(f"cancelled {ids[0]}"), said
        at_cancel = stored_turns(store, ids)
        result = await asyncio.wait_for(handle.result(), 120)
        rollouts = {r["rollout_id"]: r for r in export(store, run_id)[0]}
        await ledger(store, run_id, client=client)
    assert result.done and sorted(rollouts) == sorted(ids)
    assert (rollouts[ids[0]]["outcome"], rollouts[ids[0]]["reason"]) == ("cancelled", "manual")
    assert all((rollouts[r]["outcome"], rollouts[r]["reward"]) == ("completed", 1.0) for r in ids[1:])
    scheduled = (await group_events(client, f"{run_id}/{group_id(0)}")).count(
        EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    )
    assert scheduled == 2, "the others must run on in a second batch"
    assert all(requests[k] == 1 for k in at_cancel), {k: requests[k] for k in at_cancel}


@pytest.mark.timeout(150)
async def test_an_engine_restart_mid_batch_is_waited_out_and_no_stored_turn_is_sampled_again(
    client: Client,
    task_queue: str,
    tmp_path: Path,
    ledger: Callable[..., Awaitable[Any]],
    fault_proxy: Callable[[str], Awaitable[FaultProxy]],
) -> None:
    """The only engine refuses every connection for four seconds while batches hold rollouts part-way
    through (three turns each), as a restart does: the batch's calls retry (and past their retries wait
    the outage out, ``engine.outage_budget_s``), every rollout completes, and the turns stored before the
    outage are not asked of the engine again."""
    groups, size, turns = 3, 4, 3
    run_id = "batched-outage"
    ids = [rollout_id(run_id, group_id(g), i) for g in range(groups) for i in range(size)]
    sim, tasks = scripted(tmp_path, turns, decode_ms_per_token=100)
    requests = counting(sim)
    async with sim.serve(port=0) as upstream, worker(client, task_queue, tmp_path, sandboxed=False) as store:
        proxy = await fault_proxy(upstream)
        handle = await start_run(
            client, batched_config(proxy.url, task_queue, groups, size, turns, tasks), run_id
        )
        for _ in range(1200):  # until some rollout has a turn stored and no record
            recorded = {r["rollout_id"] for r in store.rollouts(run_id)}
            if {rid for rid, _ in stored_turns(store, ids)} - recorded:
                break
            await asyncio.sleep(0.05)
        proxy.set(Fault.RESET)
        at_outage = stored_turns(store, ids)
        await asyncio.sleep(4.0)
        refused = proxy.hits
        proxy.clear()
        result = await asyncio.wait_for(handle.result(), 120)
        rollouts, _ = export(store, run_id)
        await ledger(store, run_id, client=client)
    assert refused > 0, "no call met the outage"
    assert result.done and sorted(r["rollout_id"] for r in rollouts) == sorted(ids)
    assert {(r["outcome"], r["reward"]) for r in rollouts} == {("completed", 1.0)}
    assert all(requests[k] == 1 for k in at_outage), {k: requests[k] for k in at_outage}
