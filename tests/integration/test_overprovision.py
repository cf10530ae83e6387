"""run.overprovision through RunWorkflow on the simulated engine (real Temporal dev server): the dispatcher
keeps that many groups beyond the trainer queue limit, the feed takes the first complete groups and the
extra one waits for the next batch, taken there before younger groups; every member ends exactly once
and the books balance. In fixed-cap mode the extra groups run in flight on top of max_inflight_groups."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.trainer.feed import TrainerFeed
from durable_rollouts.workflows.run import RunWorkflow
from tests.integration.support import export, make_config, start_run, worker

# Random-policy turns of 24-48 tokens at 40 ms a token: a group runs for a second or two.
SLOW = {"policy": "random", "random_min_tokens": 24, "random_max_tokens": 48, "decode_ms_per_token": 40}
FAST_POLL = {"enabled": True, "poll_interval_s": 0.3, "admit_window_s": 0.0, "metrics_max_age_s": 10.0}


@pytest.mark.timeout(300)
async def test_an_over_provisioned_group_waits_for_the_next_batch_and_is_taken_first(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    async with SimEngine(SimSettings(policy="random")).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": 6, "group_size": 2, "overprovision": 1},
            admission={**FAST_POLL, "initial_cap": 16, "max_queued_groups": 2},
        )
        async with worker(client, task_queue, tmp_path) as store:
            store.put_policy("v0", "h", "/w", [url])
            store.finish_policy("v0", [url])
            feed = TrainerFeed(store, "over")
            handle = await start_run(client, cfg, "over")
            taken: list[list[str]] = []
            # queue limit 2 + 1 extra: three groups, then five (one was left waiting), then all six
            for done in (3, 5, 6):
                for _ in range(200):
                    if len(store.groups("over")) >= done:
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.5)  # five polls: nothing more is admitted while three groups wait
                assert len(store.groups("over")) == done
                taken.append([g.group_id for g in feed.take(2, "v0", max_lag=0).groups])
            result = await handle.result()
            rollouts, groups = export(store, "over")
            ledger = feed.ledger().check()
    assert result.done and result.groups_done == 6
    # the extra group of each round waits and leads the next batch (oldest first), none is dropped
    assert taken == [["g000000", "g000001"], ["g000002", "g000003"], ["g000004", "g000005"]]
    ids = [r["rollout_id"] for r in rollouts]
    assert len(ids) == len(set(ids)) == 12 and len(groups) == 6  # every member ended exactly once
    assert ledger.waiting.records == 0 and ledger.discarded.records == 0 and ledger.consumed.records == 12


@pytest.mark.timeout(300)
async def test_fixed_cap_mode_keeps_the_extra_groups_in_flight(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    async with SimEngine(SimSettings(**SLOW)).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": 8, "group_size": 2, "max_inflight_groups": 2, "overprovision": 2},
            sampling={"max_tokens": 64},
        )
        async with worker(client, task_queue, tmp_path) as store:
            handle = await start_run(client, cfg, "fixed-over")
            seen: set[int] = set()
            while not (p := await handle.query(RunWorkflow.progress)).done:
                seen.add(p.groups_inflight)
                await asyncio.sleep(0.05)
            await handle.result()
            rollouts, groups = export(store, "fixed-over")
    assert max(seen) == 4  # max_inflight_groups + overprovision, never more
    ids = [r["rollout_id"] for r in rollouts]
    assert len(ids) == len(set(ids)) == 16 and len(groups) == 8
