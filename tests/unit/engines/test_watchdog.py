"""Hang detection (engines/watchdog.py) against the simulated engine over HTTP: a hung port and a stalled
generation fail the call as EngineStalled; a slow engine that keeps producing tokens, and a request queued
behind others that progress, are not stalls; a call that ends within one probe interval probes nothing."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.engines.client import EngineClient, Generation
from durable_rollouts.engines.watchdog import PROBE_FRACTION, progress_counter, watching
from durable_rollouts.errors import EngineStalled, EngineUnavailable
from durable_rollouts.faults import Fault, FaultProxy
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.simengine.settings import TimingSettings

pytestmark = pytest.mark.timeout(60)

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=256, seed=7, logprob_mode="processed_logprobs"
)
STALL_S = 0.6

Served = tuple[SimEngine, str, EngineClient, list[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    """Engines on free ports (random policy), each with a client whose probes are counted."""
    stack: list[Any] = []

    async def start(**overrides: Any) -> Served:
        engine = SimEngine(SimSettings(**{"policy": "random", **overrides}))
        cm = engine.serve(port=0)
        url = await cm.__aenter__()
        client = EngineClient(timeout_s=30)
        probes: list[str] = []

        async def count(request: httpx.Request) -> None:
            probes.append(request.url.path)

        client.watchdog._http.event_hooks["request"].append(count)
        stack.append((cm, client))
        return engine, url, client, probes

    yield start
    for cm, client in reversed(stack):
        await client.aclose()
        await cm.__aexit__(None, None, None)


async def _gen(client: EngineClient, url: str, request_id: str = "r/g/0/0/1") -> Generation:
    return await client.generate(url, "tiny", [1, 2, 3, 4], SAMPLING, SAMPLING.max_tokens, request_id)


def _stalled_for(e: BaseException) -> float:
    """The silence the watchdog measured, from its message."""
    m = re.search(r"for (\d+\.\d)s", str(e))
    assert m is not None, str(e)
    return float(m.group(1))


def test_the_token_counters_are_summed_over_label_sets_and_only_theirs() -> None:
    text = "\n".join(
        [
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            'vllm:generation_tokens_total{engine="0",model_name="tiny"} 120.0',
            'vllm:generation_tokens_total{engine="1",model_name="tiny"} 30.0',
            'vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7e9',
            'vllm:prompt_tokens_total{engine="0",model_name="a model"} 1e3',
            'vllm:prompt_tokens_total_by_source{engine="0"} 99.0',
            "vllm:num_requests_running 4.0",
        ]
    )
    assert progress_counter(text) == 1150.0
    assert progress_counter("vllm:prompt_tokens_total 5 1700000000\n") == 5.0  # with a timestamp
    assert progress_counter("vllm:num_requests_running 4.0\n") is None


async def test_a_port_that_accepts_and_never_answers_fails_the_call_within_the_stall_timeout(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    _, url, client, probes = await serve()
    async with FaultProxy(_host_port(url)) as proxy:
        # known before the hang, as for a replica that was serving (no pooled connection to the proxy)
        client._max_len[proxy.url] = await client.max_model_len(url, "tiny")
        proxy.set(Fault.HANG)
        with watching(STALL_S), pytest.raises(EngineStalled, match="no answer to GET /metrics") as err:
            await _gen(client, proxy.url)
    assert issubclass(EngineStalled, EngineUnavailable) and not EngineStalled.retryable
    assert STALL_S <= _stalled_for(err.value) <= STALL_S * (1 + PROBE_FRACTION) + 0.1
    assert "/metrics" in probes


async def test_an_engine_answering_while_its_generation_stalls_fails_the_call(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    engine, url, client, probes = await serve(random_min_tokens=8, random_max_tokens=8)
    engine.faults.hang = True  # /health and /metrics answer; generate requests wait
    try:
        with watching(STALL_S), pytest.raises(EngineStalled, match="no token processed") as err:
            await _gen(client, url)
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{url}/health")).status_code == 200
    finally:
        engine.faults.hang = False
    assert STALL_S <= _stalled_for(err.value) <= STALL_S * (1 + 2 * PROBE_FRACTION) + 0.1
    assert probes.count("/metrics") >= 2


async def test_a_slow_engine_that_keeps_producing_tokens_is_not_stalled_and_its_reply_is_unchanged(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    """65 tokens at 20 ms each: the call lasts twice the stall timeout, its counters move every 16."""
    _, url, client, probes = await serve(random_min_tokens=64, random_max_tokens=64, decode_ms_per_token=20)
    with watching(STALL_S):
        watched = await _gen(client, url, "r/g/0/0/1")
    with watching(0):
        plain = await _gen(client, url, "r/g/0/0/1")
    assert len(watched.token_ids) == 65 and watched.model_s > 2 * STALL_S  # 64 and the end of turn
    assert (watched.token_ids, watched.logprobs, watched.policy_versions, watched.finish_reason) == (
        plain.token_ids,
        plain.logprobs,
        plain.policy_versions,
        plain.finish_reason,
    )
    assert probes.count("/metrics") >= 4


async def test_the_timing_model_counts_tokens_as_they_are_sampled(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    """Steps of 20 ms: 65 tokens take 1.3 s, twice the stall timeout, and the counter moves meanwhile."""
    timing = TimingSettings(step_base_ms=20.0, step_per_seq_ms=0.0, prefill_ms_per_token=0.0)
    _, url, client, _ = await serve(random_min_tokens=64, random_max_tokens=64, timing=timing)
    async with httpx.AsyncClient() as http:
        before = progress_counter((await http.get(f"{url}/metrics")).text)
        with watching(STALL_S):
            call = asyncio.ensure_future(_gen(client, url))
            await asyncio.sleep(STALL_S)
            during = progress_counter((await http.get(f"{url}/metrics")).text)
            gen = await call
        after = progress_counter((await http.get(f"{url}/metrics")).text)
    assert len(gen.token_ids) == 65 and gen.model_s > 2 * STALL_S
    assert before is not None and during is not None and after is not None
    assert before < during < after and after - before == 4 + 65  # the prompt and every sampled token


async def test_a_request_queued_behind_others_that_progress_is_not_stalled(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    """One sequence at a time, three requests of 0.5 s: the last waits 1 s with none of its own tokens."""
    _, url, client, _ = await serve(
        random_min_tokens=32, random_max_tokens=32, decode_ms_per_token=16, max_num_seqs=1
    )
    with watching(STALL_S):
        gens = await asyncio.gather(*(_gen(client, url, f"r/g/0/{i}/1") for i in range(3)))
    assert [len(g.token_ids) for g in gens] == [33, 33, 33]
    assert max(g.model_s for g in gens) > STALL_S + 0.3


async def test_a_worker_that_did_not_run_for_a_while_blames_nothing_on_the_engine(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    """The event loop blocked for longer than the stall timeout mid-call (as a SIGSTOPped worker; the
    simulated engine shares the loop, so it pauses too and then goes on): no probe could run, and the call
    ends with its reply instead of failing as a stall."""
    _, url, client, probes = await serve(random_min_tokens=64, random_max_tokens=64, decode_ms_per_token=20)
    with watching(STALL_S):
        call = asyncio.ensure_future(_gen(client, url))
        await asyncio.sleep(STALL_S / 2)
        time.sleep(2 * STALL_S)  # the point: nothing of this process runs
        gen = await call
    assert len(gen.token_ids) == 65
    assert probes.count("/metrics") >= 1


async def test_a_call_that_ends_within_one_probe_interval_probes_nothing(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    _, url, client, probes = await serve()
    with watching(STALL_S):
        for i in range(20):
            await _gen(client, url, f"r/g/0/{i}/1")
    await asyncio.sleep(STALL_S)  # a probe loop left running would probe now
    assert probes == []


def _host_port(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    assert u.port is not None
    return u.host, u.port
