"""Infra retries that keep groups whole, through the real pipeline (Temporal dev server, worker, store) with
two simulated replicas, one behind a fault proxy that resets every connection: a rollout that hashes to the
broken replica fails for infrastructure (no failover, no outage budget) and its slot runs again as a fresh
attempt ``<i>r1``, which hashes elsewhere.

- ``exclude`` (retry scored): the slot has two records, the failed one marked superseded by the retry; the
  group compares all its slots; the ledger is clean (Temporal included) and the feed's books balance.
- ``fail-group`` (retry hashes to the broken replica too): the group is unscorable, its members carry no
  advantage and are not scorable, and the trainer feed discards it (reason unscorable).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.faults import Fault, FaultProxy
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.trainer.feed import TrainerFeed
from durable_rollouts.workflows.rollout import pick_engine
from tests.integration.support import (
    assert_schema_valid,
    export,
    export_lines,
    make_config,
    run_to_end,
    worker,
)

SIM = {"policy": "random", "random_min_tokens": 2, "random_max_tokens": 4, "decode_ms_per_token": 5}
SIZE = 3


@pytest.fixture
async def replicas(fault_proxy: Callable[[str], Awaitable[FaultProxy]]) -> AsyncIterator[tuple[str, str]]:
    """A healthy simulated replica and the URL of a second one behind a proxy that resets every call."""
    good, bad = SimEngine(SimSettings(**SIM)), SimEngine(SimSettings(**SIM))
    async with good.serve(port=0) as good_url, bad.serve(port=0) as bad_url:
        proxy = await fault_proxy(bad_url)
        proxy.set(Fault.RESET)
        yield good_url, proxy.url


def _run_id(prefix: str, urls: list[str], retry_reaches_bad: bool) -> tuple[str, int]:
    """A run id whose group 0 has exactly one slot on the broken replica (``urls[1]``), whose retry ``r1``
    hashes to the broken one too (``retry_reaches_bad``) or to the healthy one; and that slot."""
    for k in range(10_000):
        run_id = f"{prefix}-{k}"
        on_bad = [i for i in range(SIZE) if pick_engine(urls, rollout_id(run_id, group_id(0), i)) == urls[1]]
        if len(on_bad) == 1:
            retry = pick_engine(urls, rollout_id(run_id, group_id(0), on_bad[0]) + "r1")
            if (retry == urls[1]) == retry_reaches_bad:
                return run_id, on_bad[0]
    raise AssertionError("no run id fits")


def _config(urls: list[str], task_queue: str, on_infra_failure: str) -> Any:
    return make_config(
        urls, task_queue,
        run={"num_groups": 1, "group_size": SIZE},
        rollout={"max_turns": 1, "infra_retries": 1},
        group={"on_infra_failure": on_infra_failure},
        engine={"affinity": "rollout", "failover": False, "max_attempts": 2, "outage_budget_s": 0},
    )  # fmt: skip


@pytest.mark.timeout(300)
async def test_a_member_failed_by_a_broken_replica_runs_again_and_its_group_compares_whole(
    client: Client, replicas: tuple[str, str], task_queue: str, tmp_path: Path, ledger: Any
) -> None:
    urls = list(replicas)
    run_id, slot = _run_id("infra-retry", urls, retry_reaches_bad=False)
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, _config(urls, task_queue, "exclude"), run_id)
        await ledger(store, run_id, client=client)
    rollouts, (group,) = export(store, run_id)
    assert_schema_valid(export_lines(store, run_id))
    first, retry = rollout_id(run_id, group_id(0), slot), rollout_id(run_id, group_id(0), slot) + "r1"
    by_id = {r["rollout_id"]: r for r in rollouts}
    assert len(rollouts) == SIZE + 1 and result.outcomes == {"completed": SIZE, "failed": 1}
    assert by_id[first]["outcome"] == "failed" and by_id[first]["reason"].startswith(
        "infra: EngineUnavailable"
    )
    assert by_id[first]["superseded_by"] == retry and by_id[first]["advantage"] is None
    assert by_id[retry]["outcome"] == "completed" and by_id[retry]["scorable"]
    assert by_id[retry]["advantage"] is not None and by_id[retry]["turns"][0]["engine"] == urls[0]
    assert (group["size"], group["scorable"], group["failed"], group["superseded"]) == (SIZE, SIZE, 1, 1)
    assert group["unscorable_reason"] is None
    assert TrainerFeed(store, run_id).ledger().check().waiting.records == SIZE + 1


@pytest.mark.timeout(300)
async def test_fail_group_makes_a_group_whose_member_stays_failed_unscorable(
    client: Client, replicas: tuple[str, str], task_queue: str, tmp_path: Path, ledger: Any
) -> None:
    urls = list(replicas)
    run_id, slot = _run_id("infra-fail-group", urls, retry_reaches_bad=True)
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, _config(urls, task_queue, "fail-group"), run_id)
        await ledger(store, run_id, client=client)
        store.put_policy("v0", "h0", "/w", [])
        store.finish_policy("v0", [])
        batch = TrainerFeed(store, run_id).take(10, "v0", max_lag=10)
    rollouts, (group,) = export(store, run_id)
    last = rollout_id(run_id, group_id(0), slot) + "r1"
    assert result.outcomes == {"completed": SIZE - 1, "failed": 2}
    assert group["unscorable_reason"].startswith(f"{last}: infra: EngineUnavailable")
    assert group["scorable"] == 0 and group["reward_mean"] is None
    assert all(not r["scorable"] and r["advantage"] is None for r in rollouts)
    assert batch.groups == [] and [d.reason.split(":")[0] for d in batch.discarded] == ["unscorable"]
    TrainerFeed(store, run_id).ledger().check()
