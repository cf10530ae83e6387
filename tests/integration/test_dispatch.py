"""The dispatcher against the simulated engine (and Docker for the sandbox pool): adaptive admission,
cancels for admission, affinity, sandbox-pool gating. Real Temporal dev server throughout."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, SimEngine, SimSettings
from tests.integration.support import (
    CODING_TASKS,
    assert_no_containers,
    coding_config,
    export,
    make_config,
    run_to_end,
    worker,
)

# Random-policy turns of 24-48 tokens at 40 ms a token: a 3-turn rollout runs for seconds, long enough
# for several polls at 0.3 s.
SLOW = {"policy": "random", "random_min_tokens": 24, "random_max_tokens": 48, "decode_ms_per_token": 40}
FAST_POLL = {"enabled": True, "poll_interval_s": 0.3, "admit_window_s": 0.0, "metrics_max_age_s": 10.0}


@pytest.fixture
async def two_replicas() -> AsyncIterator[list[str]]:
    async with (
        SimEngine(SimSettings(**SLOW)).serve(port=0) as a,
        SimEngine(SimSettings(**SLOW)).serve(port=0) as b,
    ):
        yield [a, b]


@pytest.mark.timeout(300)
async def test_every_turn_of_a_rollout_and_every_member_of_a_group_stays_on_one_replica(
    client: Client, two_replicas: list[str], task_queue: str, tmp_path: Path
) -> None:
    cfg = make_config(
        two_replicas,
        task_queue,
        run={"num_groups": 6, "group_size": 3},
        rollout={"max_turns": 3},
        sampling={"max_tokens": 64},
        admission={**FAST_POLL, "initial_cap": 18, "max_inflight": 64},
    )
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, cfg, "affinity")
        log = store.dispatch_log("affinity")
    rollouts, groups = export(store, "affinity")
    assert result.done and len(rollouts) == 18 and len(groups) == 6
    by_group: dict[str, set[str]] = defaultdict(set)
    for rec in rollouts:
        engines = {t["engine"] for t in rec["turns"]}
        assert len(engines) == 1, rec["rollout_id"]  # 100% of a rollout's turns on one replica
        assert len(rec["turns"]) >= 2 or rec["outcome"] == "completed"
        by_group[rec["group_id"]] |= engines
    assert all(len(e) == 1 for e in by_group.values())  # a group shares its prompt prefix on one replica
    placed = [e for es in by_group.values() for e in es]
    assert set(placed) == set(two_replicas)  # bounded load: six groups of three do not all go to one
    assert log and log[0]["cap"] == 18 and all(entry["healthy"] == sorted(two_replicas) for entry in log)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("redispatch", [False, True])
async def test_a_full_kv_cache_cancels_the_youngest_rollouts_for_admission(
    client: Client, task_queue: str, tmp_path: Path, redispatch: bool
) -> None:
    # 40 blocks of 16 tokens: a request reserves prompt + max_tokens (~100 tokens), so 16 rollouts at once
    # need ~2.5x the cache; usage goes over 90% and the controller cancels the excess, youngest first.
    async with SimEngine(SimSettings(**SLOW, num_gpu_blocks=40, max_model_len=640)).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": 4, "group_size": 4, "max_inflight_groups": 4},
            rollout={"max_turns": 3},
            sampling={"max_tokens": 64},
            admission={
                **FAST_POLL,
                "preset": "prime-rl",  # hard trims cancel; the probe preset never cancels
                "initial_cap": 16,
                "max_model_len": 640,
                "redispatch_cancelled": redispatch,
            },
        )
        run_id = f"trim-{redispatch}"
        async with worker(client, task_queue, tmp_path) as store:
            result = await run_to_end(client, cfg, run_id)
            log = store.dispatch_log(run_id)
    rollouts, groups = export(store, run_id)
    shed = [r for r in rollouts if r["outcome"] == "cancelled"]
    assert shed, [(e["cap"], e["inflight"], e["kv_usage"], e["reasons"]) for e in log]
    assert all(r["reason"] == "admission" and not r["scorable"] and r["reward"] is None for r in shed)
    assert any("hard trim" in why for entry in log for why in entry["reasons"])
    assert result.admission_cancelled == len(shed) == sum(g["admission_cancelled"] for g in groups), (
        [(r["rollout_id"], r["outcome"], r["reason"], r.get("wasted_tokens")) for r in rollouts],
        groups,
    )
    assert result.wasted_tokens == sum(r["wasted_tokens"] for r in shed)  # 0 if cut in their first turn
    # the youngest go first: all four groups started at one poll, so ties go to the highest group id
    per_group = defaultdict(int)
    for r in shed:
        per_group[r["group_id"]] += 1
    assert per_group["g000003"] > 0 and per_group["g000003"] >= per_group["g000000"]
    assert len(groups) == 4 and all(g["size"] == 4 for g in groups)
    slots = defaultdict(list)
    for r in rollouts:
        slots[(r["group_id"], r["sample_index"])].append(r)
    assert len(slots) == 16  # every slot has a record; a rollout id never appears twice
    assert len({r["rollout_id"] for r in rollouts}) == len(rollouts)
    for (_gid, i), recs in slots.items():
        recs.sort(key=lambda r: len(r["rollout_id"]))
        names = [r["rollout_id"].rsplit("/", 1)[1] for r in recs]
        if redispatch:  # a shed slot ran again as <i>r1, <i>r2, ...: every attempt but the last was shed
            assert names == [str(i)] + [f"{i}r{k}" for k in range(1, len(recs))]
            assert all(r["reason"] == "admission" for r in recs[:-1])
            assert recs[-1]["reason"] != "admission" or len(recs) == 4
        else:
            assert names == [str(i)]


@pytest.mark.timeout(600)
async def test_a_slow_scaling_sandbox_pool_delays_rollouts_but_fails_none(
    client: Client, docker: DockerBackend, task_queue: str, tmp_path: Path
) -> None:
    settings = SimSettings(tasks=CODING_TASKS, mode=Mode.REFERENCE, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        cfg = coding_config(
            url,
            task_queue,
            groups=4,
            size=2,
            admission={**FAST_POLL, "initial_cap": 8, "max_model_len": 4096},
            sandbox_pool={
                "initial_size": 1,
                "max_size": 4,
                "scale_up_latency_s": 2.0,
                "tasks_per_minute": 60.0,
            },
        )
        async with worker(client, task_queue, tmp_path) as store:
            result = await run_to_end(client, cfg, "pool-run")
            log = store.dispatch_log("pool-run")
    rollouts, _ = export(store, "pool-run")
    assert result.done and len(rollouts) == 8
    for rec in rollouts:  # no rollout failed for want of a sandbox
        assert rec["outcome"] == "completed" and rec["reward"] == 1.0, rec["reason"]
    pools = [e["pool"] for e in log if e["pool"] is not None]
    assert pools and pools[0]["ready"] == 1 and max(p["ready"] for p in pools) >= 2  # it scaled up
    assert all(p["ready"] + p["starting"] <= 4 and p["in_use"] <= p["ready"] for p in pools)
    assert all(e["inflight"] + e["admitted"] <= 4 for e in log)  # dispatch follows the pool's limit
    assert any("sandbox pool" in why for e in log for why in e["reasons"])
    assert_no_containers(docker, "pool-run")


@pytest.mark.timeout(300)
async def test_generation_waits_for_the_trainer_when_the_queue_limit_is_reached(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    from durable_rollouts.trainer.feed import TrainerFeed
    from tests.integration.support import start_run

    async with SimEngine(SimSettings(policy="random")).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": 6, "group_size": 2},
            admission={**FAST_POLL, "initial_cap": 16, "max_queued_groups": 2},
        )
        async with worker(client, task_queue, tmp_path) as store:
            store.put_policy("v0", "h", "/w", [url])
            store.finish_policy("v0", [url])
            feed = TrainerFeed(store, "queued")
            handle = await start_run(client, cfg, "queued")
            for done in (2, 4, 6):
                for _ in range(200):
                    if len(store.groups("queued")) >= done:
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.5)  # five polls: nothing more is admitted while two groups wait
                assert len(store.groups("queued")) == done
                assert len(feed.take(2, "v0", max_lag=0).groups) == 2
            result = await handle.result()
            log = store.dispatch_log("queued")
    assert result.done and result.groups_done == 6
    assert any("wait for the trainer" in why for e in log for why in e["reasons"])
    assert feed.ledger().check().waiting.records == 0


@pytest.mark.timeout(300)
async def test_rollouts_of_a_replica_killed_mid_run_finish_on_the_other_each_exactly_once(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    from contextlib import AsyncExitStack

    from tests.integration.support import start_run

    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(SimEngine(SimSettings(**SLOW)).serve(port=0))
        doomed = AsyncExitStack()
        b = await doomed.enter_async_context(SimEngine(SimSettings(**SLOW)).serve(port=0))
        cfg = make_config(
            [a, b],
            task_queue,
            run={"num_groups": 4, "group_size": 3},
            rollout={"max_turns": 3},
            sampling={"max_tokens": 64},
            engine={"max_attempts": 2},
            admission={**FAST_POLL, "initial_cap": 12, "metrics_max_age_s": 1.0},
        )
        store = await stack.enter_async_context(worker(client, task_queue, tmp_path))
        handle = await start_run(client, cfg, "killed")
        for _ in range(200):  # until all twelve run (the log is written one poll later)
            if any(e["inflight"] >= 12 for e in store.dispatch_log("killed")):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # a turn or so in: b's rollouts hold context there
        await doomed.aclose()  # replica b dies mid-run
        result = await handle.result()
    rollouts, groups = export(store, "killed")
    assert result.done and len(groups) == 4
    assert len(rollouts) == 12 and len({r["rollout_id"] for r in rollouts}) == 12  # each exactly once
    assert all(r["outcome"] == "completed" for r in rollouts), [r["reason"] for r in rollouts]
    moved = [r for r in rollouts if r.get("engine_failovers")]
    assert moved, "some rollouts were on the killed replica"
    for r in moved:  # a turn b sampled before it died is kept (not sampled again); later ones are a's
        engines = [t["engine"] for t in r["turns"]]
        assert r["reprefill_tokens"] > 0 and set(engines) <= {a, b}
        assert [t["turn"] for t in r["turns"]] == list(range(len(engines)))
        assert b not in engines[engines.index(a) :] if a in engines else True
