"""Engine faults injected by the fault proxy through a running pipeline, each run ending with the ledger
check clean: 5xx bursts, resets, truncated replies and hangs in front of the simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from temporalio.client import Client

from faults import Fault, FaultProxy, LedgerReport
from simengine import SimEngine, SimSettings
from tests.integration.support import make_config, run_to_end, worker

SIM = {"policy": "random", "random_min_tokens": 4, "random_max_tokens": 8, "decode_ms_per_token": 20}


@pytest.fixture
async def proxied(fault_proxy: Callable[[str], Awaitable[FaultProxy]]) -> AsyncIterator[FaultProxy]:
    async with SimEngine(SimSettings(**SIM)).serve(port=0) as url:
        yield await fault_proxy(url)


async def _flap(proxy: FaultProxy, fault: Fault, on_s: float, off_s: float, **kw: float) -> None:
    """The fault in force for ``on_s``, cleared for ``off_s``, again and again."""
    while True:
        proxy.set(fault, **kw)  # type: ignore[arg-type]
        await asyncio.sleep(on_s)
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
