"""Engine faults injected by the fault proxy through a running pipeline, each run ending with the ledger
check clean: 5xx bursts, resets, truncated replies and hangs in front of the simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.faults import Fault, FaultProxy, LedgerReport
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.stack.procs import free_port
from durable_rollouts.store import RunStore
from durable_rollouts.trainer.feed import TrainerFeed
from tests.integration.support import export, make_config, run_to_end, start_run, worker

SIM = {"policy": "random", "random_min_tokens": 4, "random_max_tokens": 8, "decode_ms_per_token": 20}


@pytest.fixture
async def proxied(fault_proxy: Callable[[str], Awaitable[FaultProxy]]) -> AsyncIterator[FaultProxy]:
    async with SimEngine(SimSettings(**SIM)).serve(port=0) as url:
        yield await fault_proxy(url)


async def _flap(proxy: FaultProxy, fault: Fault, on_s: float, off_s: float, **kw: float) -> None:
    """The fault in force for ``on_s``, cleared for ``off_s``, again and again; the first time it stays
    in force until it has acted at least once (up to 30 s), so a run that starts slowly and then ends
    within one cleared spell still meets it."""
    while True:
        proxy.set(fault, **kw)  # type: ignore[arg-type]
        await asyncio.sleep(on_s)
        for _ in range(300):  # only the first spell waits: later, hits are already counted
            if proxy.hits:
                break
            await asyncio.sleep(0.1)
        proxy.clear()
        await asyncio.sleep(off_s)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("fault", "kw"),
    [(Fault.HTTP_5XX, {}), (Fault.RESET, {}), (Fault.TRUNCATE, {"bytes": 60}), (Fault.HANG, {})],
    ids=lambda v: str(v),
)
async def test_engine_faults_are_ridden_out_and_the_ledger_is_clean(
    client: Client,
    proxied: FaultProxy,
    ledger: Callable[..., Awaitable[LedgerReport]],
    task_queue: str,
    tmp_path: Path,
    fault: Fault,
    kw: dict,
) -> None:
    run_id = f"faults-{fault.value}"
    cfg = make_config(
        [proxied.url], task_queue,
        run={"num_groups": 4, "group_size": 2, "max_inflight_groups": 4},
        rollout={"max_turns": 3},
        engine={"max_attempts": 20, "request_timeout_s": 2.0, "retry_initial_s": 0.2, "retry_max_s": 0.5},
    )  # fmt: skip
    async with worker(client, task_queue, tmp_path) as store:
        flapping = asyncio.ensure_future(_flap(proxied, fault, 0.4, 0.8, **kw))
        try:
            result = await run_to_end(client, cfg, run_id)
        finally:
            flapping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flapping
            proxied.clear()
        report = await ledger(store, run_id, client=client)
        attempts = [
            seg.meta.get("attempt", 1)
            for r in store.rollouts(run_id)
            for seg in store.segments(r["rollout_id"])
            if seg.kind == "model"
        ]
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert report.rollouts == 8 and report.successes == 8
    assert sum(e.setting.fault == fault for e in proxied.events) >= 2  # the fault was set, repeatedly
    assert max(attempts) > 1, "no model call was ever retried: the fault never hit the pipeline"


@pytest.mark.timeout(300)
async def test_a_restart_of_the_only_engine_delays_rollouts_instead_of_failing_them(
    client: Client, ledger: Callable[..., Awaitable[LedgerReport]], task_queue: str, tmp_path: Path
) -> None:
    """The engine goes away for longer than the model call's retries last (its port closed) and comes
    back on the same address: no rollout fails; they wait the outage out (engine.outage_budget_s)."""
    port = free_port()
    slow = {**SIM, "decode_ms_per_token": 60}
    run_id = "engine-restart"
    cfg = make_config(
        [f"http://127.0.0.1:{port}"], task_queue,
        run={"num_groups": 3, "group_size": 2, "max_inflight_groups": 3},
        rollout={"max_turns": 3},
        engine={"max_attempts": 2, "retry_initial_s": 0.2, "retry_max_s": 0.2, "outage_budget_s": 120},
    )  # fmt: skip
    async with worker(client, task_queue, tmp_path) as store:
        async with SimEngine(SimSettings(**slow)).serve(port=port):
            handle = await start_run(client, cfg, run_id)
            await wait_for_model_turns(store, run_id, 2)
        await asyncio.sleep(6.0)  # down: every attempt in this window is refused
        async with SimEngine(SimSettings(**slow)).serve(port=port):
            result = await asyncio.wait_for(handle.result(), 240)
        report = await ledger(store, run_id, client=client)
        rollouts, _ = export(store, run_id)
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert report.rollouts == 6 and report.successes == 6
    assert max(r["time"]["wall_s"] for r in rollouts) >= 6.0  # some rollout lived through the outage


async def wait_for_model_turns(store: RunStore, run_id: str, n: int, timeout_s: float = 60.0) -> None:
    """Until the run's rollouts have ``n`` model turns stored in all."""
    for _ in range(int(timeout_s * 10)):
        ids = [rollout_id(run_id, group_id(g), k) for g in range(8) for k in range(8)]
        rows = [s for rid in ids for s in store.segments(rid) if s.kind == "model"]
        if len(rows) >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id}: fewer than {n} model turns in {timeout_s}s")


@pytest.mark.timeout(300)
async def test_samples_under_a_version_label_never_published_are_refused(
    client: Client, ledger: Callable[..., Awaitable[LedgerReport]], task_queue: str, tmp_path: Path
) -> None:
    """A restarted engine reports a label nobody published (vLLM says ``default``): its samples are not
    stored; the rollouts wait until it serves the published version again, and no record carries the
    unknown label."""
    run_id = "unknown-label"
    cfg = make_config(
        ["http://127.0.0.1:1"], task_queue,  # replaced below
        run={"num_groups": 3, "group_size": 2, "max_inflight_groups": 3},
        rollout={"max_turns": 3},
        engine={"max_attempts": 2, "retry_initial_s": 0.2, "retry_max_s": 0.2, "outage_budget_s": 120},
    )  # fmt: skip
    async with SimEngine(SimSettings(**{**SIM, "decode_ms_per_token": 40})).serve(port=0) as url:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"urls": [url]})})
        async with httpx.AsyncClient(timeout=10) as http, worker(client, task_queue, tmp_path) as store:
            await _label(http, url, "v0")
            store.put_policy("v0", "hash-v0", "/weights/v0", [url])
            store.finish_policy("v0", [url])
            handle = await start_run(client, cfg, run_id)
            await wait_for_model_turns(store, run_id, 2)
            await _label(http, url, "default")  # as after a restart from the engine's own files
            await asyncio.sleep(3.0)
            await _label(http, url, "v0")  # `rollouts policy publish v0` again
            result = await asyncio.wait_for(handle.result(), 240)
            await ledger(store, run_id, client=client)
            rollouts, _ = export(store, run_id)
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    labels = {v for r in rollouts for v in r["policy_versions"] if v is not None}
    assert labels == {"v0"}, labels
    assert all(r["lineage"]["policy_versions"] == ["v0"] for r in rollouts)


async def _label(http: httpx.AsyncClient, url: str, version: str) -> None:
    (await http.post(f"{url}/update_weight_version", json={"new_version": version})).raise_for_status()


@pytest.mark.timeout(300)
async def test_an_engine_serving_the_other_logprobs_mode_is_refused(
    client: Client, ledger: Callable[..., Awaitable[LedgerReport]], task_queue: str, tmp_path: Path
) -> None:
    """Two replicas, one started with raw_logprobs while the run declares processed_logprobs: every
    rollout sent there fails over, so every turn was sampled by an engine that said it serves the
    declared mode; with only the wrong engine, nothing is sampled at all and nothing reaches a trainer."""
    raw = SimSettings(**{**SIM, "logprob_mode": "raw_logprobs"})
    async with SimEngine(SimSettings(**SIM)).serve(port=0) as good, SimEngine(raw).serve(port=0) as bad:
        mixed = make_config(
            [good, bad], task_queue,
            run={"num_groups": 4, "group_size": 2, "max_inflight_groups": 4},
            engine={"affinity": "rollout", "max_attempts": 1, "logprob_mode": "processed_logprobs"},
        )  # fmt: skip
        only_bad = make_config(
            [bad], task_queue,
            run={"num_groups": 1, "group_size": 2},
            rollout={"infra_retries": 0},  # each member fails once (retries: test_infra_retries.py)
            engine={"max_attempts": 1, "outage_budget_s": 3, "logprob_mode": "processed_logprobs"},
        )  # fmt: skip
        async with worker(client, task_queue, tmp_path) as store:
            result = await run_to_end(client, mixed, "mode-mixed")
            await ledger(store, "mode-mixed", client=client)
            refused = await run_to_end(client, only_bad, "mode-bad")
            mixed_recs, _ = export(store, "mode-mixed")
            bad_recs, _ = export(store, "mode-bad")
            store.put_policy("v0", "hash-v0", "/weights/v0", [good, bad])
            store.finish_policy("v0", [good, bad])
            batch = TrainerFeed(store, "mode-bad").take(10, "v0", 0, logprob_mode="processed_logprobs")
    assert result.outcomes.get("failed", 0) == 0, result.outcomes
    turns = [t for r in mixed_recs for t in r["turns"]]
    assert {t["engine"] for t in turns} == {good} and {t["logprob_mode"] for t in turns} == {
        "processed_logprobs"
    }
    assert sum(r.get("engine_failovers", 0) for r in mixed_recs) >= 1  # some rollouts hashed to the bad one
    assert refused.outcomes == {"failed": 2}
    assert all(
        r["reason"].startswith("infra: EngineUnavailable") and "raw_logprobs" in r["reason"] for r in bad_recs
    )
    assert all(not r["turns"] and not r["token_ids"][r["prompt_length"] :] for r in bad_recs)
    assert batch.count.tokens == 0  # the failed members hold no sampled token for a trainer to take


@pytest.mark.timeout(300)
async def test_the_temporal_server_killed_and_restarted_mid_run(
    ledger: Callable[..., Awaitable[LedgerReport]], tmp_path: Path
) -> None:
    """A Temporal dev server on its own SQLite file, SIGKILLed mid-run and started again on the same
    file and port: the worker and the client reconnect, the in-flight rollouts continue, the ledger is
    clean."""
    from durable_rollouts.contracts.client import connect
    from durable_rollouts.stack import procs

    home = tmp_path / "temporal"
    home.mkdir()
    port, ui = free_port(), free_port()
    address = f"127.0.0.1:{port}"

    def start() -> int:
        pid = procs.spawn("temporal", procs.temporal_argv(home, port, ui), home)
        procs.wait_until(lambda: procs.temporal_healthy(address), 60, "temporal", pid=pid)
        return pid

    pid = start()
    try:
        client = await connect(address)
        slow = {**SIM, "decode_ms_per_token": 60}
        async with (
            SimEngine(SimSettings(**slow)).serve(port=0) as url,
            worker(client, "restart", tmp_path / "w") as store,
        ):
            cfg = make_config(
                [url], "restart",
                run={"num_groups": 4, "group_size": 2, "max_inflight_groups": 2},
                rollout={"max_turns": 3},
            )  # fmt: skip
            handle = await start_run(client, cfg, "server-restart")
            await wait_for_model_turns(store, "server-restart", 3)
            os.kill(pid, signal.SIGKILL)
            procs.stop_pid(pid)  # reaps the group
            await asyncio.sleep(2.0)
            pid = start()
            result = await asyncio.wait_for(handle.result(), 240)
            await ledger(store, "server-restart", client=client)
        assert result.done and result.groups_done == 4 and result.outcomes.get("failed", 0) == 0, result
    finally:
        procs.stop_pid(pid)
